"""Pretrain GPT (Megatron's ``pretrain_gpt.py``): same flags, data, checkpoints and log lines.

Single process:   python pretrain_gpt.py --num-layers 2 --hidden-size 64 ... --data-path my-gpt2_text_document
Distributed:      torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ...

Data: every rank builds the same datasets and its data-parallel shard of the pretraining sampler, so the ranks of
one tensor-parallel group read the identical micro-batch deterministically (instead of Megatron's broadcast from
tensor-parallel rank 0; no communication is needed and the result is the same). With --context-parallel-size N
each rank keeps its 2 of the sequence's 2N chunks (megatron/core/context_parallel.py) and the loss is summed over the
context-parallel group before dividing, so it is the loss of the full sequence.
"""
from __future__ import annotations

import os
import sys
from functools import partial
from typing import Any, Iterator, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron import global_vars  # noqa: E402
from megatron.arguments import core_transformer_config_from_args  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.context_parallel import slice_for_cp  # noqa: E402
from megatron.core.packed_seq_params import from_cu_seqlens  # noqa: E402
from megatron.data.sft_dataset import SFTBuilder, check_sft_flags  # noqa: E402
from megatron.errors import exit_on_user_error  # noqa: E402
from megatron.layers import ModelType  # noqa: E402
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.tokenizer.chat_format import chat_format_for  # noqa: E402
from megatron.training import pretrain  # noqa: E402
from megatron.utils import average_losses_across_data_parallel_group, get_ltor_masks_and_position_ids  # noqa: E402


def _state() -> ps.ParallelState:
    return ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()


def model_provider(pre_process: bool = True, post_process: bool = True) -> GPTModel:
    """Build the GPT model for this rank's pipeline stage (under --deepspeed with PP > 1 the DeepSpeed backend builds
    GPTModelPipe instead: megatron/backend/deepspeed.py)."""
    args = global_vars.get_args()
    state = _state()
    if state.global_rank == 0:
        print(" > building GPT model ...", flush=True)
    config = core_transformer_config_from_args(args)
    return GPTModel(config, tp_group=state.tp_group, pp_state=state, num_tokentypes=0, parallel_output=True,
                    pre_process=pre_process, post_process=post_process,
                    fp16_lm_cross_entropy=bool(getattr(args, "fp16_lm_cross_entropy", False)))


def get_batch(data_iterator: Optional[Iterator]) -> tuple[Any, ...]:
    """tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params of the next micro-batch.

    A packed batch (Megatron's keys ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, ``cu_seqlens``,
    ``max_seqlen``) gives a `PackedSeqParams` and no attention mask (the model builds the documents' mask);
    otherwise packed_seq_params is None."""
    args = global_vars.get_args()
    data = next(data_iterator)
    if args.sft or "cu_seqlens" in data:  # packed conversations/documents: attention stays within each
        tokens, labels, loss_mask, position_ids, packed = packed_batch(data)
        attention_mask = None
    else:
        tokens_ = data["text"].long()
        labels = tokens_[:, 1:].contiguous()
        tokens = tokens_[:, :-1].contiguous()
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, global_vars.get_tokenizer().eod, args.reset_position_ids, args.reset_attention_mask,
            args.eod_mask_loss)
        packed = None
    state = _state()
    if state.cp_size > 1:  # this context-parallel rank's chunks r and 2N-1-r (the mask: its query rows)
        tokens, labels, loss_mask, position_ids = (slice_for_cp(t, 1, state.cp_size, state.cp_rank)
                                                   for t in (tokens, labels, loss_mask, position_ids))
        if attention_mask is not None:
            attention_mask = slice_for_cp(attention_mask, 2, state.cp_size, state.cp_rank)
    if torch.cuda.is_available() and args.distributed_backend != "gloo":
        device = torch.cuda.current_device()
        tokens, labels, loss_mask, attention_mask, position_ids = (
            t if t is None else t.cuda(device, non_blocking=True)
            for t in (tokens, labels, loss_mask, attention_mask, position_ids))
    return tokens, labels, loss_mask, attention_mask, position_ids, packed


def packed_batch(data: dict) -> tuple[Any, ...]:
    """(tokens, labels, loss_mask, position_ids, PackedSeqParams) of a packed batch dict (Megatron's SFT keys;
    position_ids restarting per document are computed from cu_seqlens when the batch has none)."""
    tokens = data["tokens"].long()
    packed = from_cu_seqlens(data["cu_seqlens"], data.get("max_seqlen"))
    position_ids = data.get("position_ids")
    if position_ids is None:
        position_ids = packed.position_ids(tokens.size(0), tokens.size(1), tokens.device)
    return tokens, data["labels"].long(), data["loss_mask"].float(), position_ids.long(), packed


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[Any, ...]:
    """Masked mean of the per-token losses; the reported value is averaged over data-parallel ranks. With
    --calculate-per-token-loss Megatron's three values instead: (sum of this rank's token losses, its number of
    loss tokens, {"lm loss": [sum, count]}); the schedule, the gradient finalisation and the log divide by the
    global batch's tokens (megatron/core/pipeline_parallel/losses.py).

    Under context parallelism the sums are taken over the full sequence (all-reduce over the CP group), and the
    loss that is back-propagated is scaled by N: gradients are averaged over the DP x CP group, in which the N
    context-parallel ranks each hold a part of one sample's gradient (Megatron-LM's rule)."""
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    if global_vars.get_args().calculate_per_token_loss:
        total = torch.sum(losses.view(-1) * loss_mask)
        count = loss_mask.sum()
        return total, count.detach().long(), {"lm loss": torch.stack([total.detach(), count.detach()])}
    state = _state()
    if state.cp_size == 1:
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        averaged = average_losses_across_data_parallel_group([loss])
        return loss, {"lm loss": averaged[0]}
    totals = torch.stack([torch.sum(losses.view(-1) * loss_mask), loss_mask.sum()]).detach()
    torch.distributed.all_reduce(totals, group=state.cp_group)  # the full sequence's sums (no gradient)
    local = torch.sum(losses.view(-1) * loss_mask) / totals[1].detach()
    full = (totals[0] / totals[1]).detach()
    averaged = average_losses_across_data_parallel_group([full])
    return local * state.cp_size, {"lm loss": averaged[0]}


def forward_step(data_iterator: Optional[Iterator], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """Megatron's forward step: (per-token losses, loss function)."""
    timers = global_vars.get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids, packed = get_batch(data_iterator)
    timers("batch-generator").stop()
    extra = {} if packed is None else {"packed_seq_params": packed}
    if global_vars.get_args().mtp_num_layers:  # the multi-token-prediction losses count the same tokens
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask, **extra)
    else:
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels, **extra)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples: list[int]) -> tuple[Any, Any, Any]:
    """GPT datasets from --data-path (or separate --train/valid/test-data-path) with Megatron's split."""
    from megatron.data.data_checks import check_data_files
    from megatron.data.gpt_dataset import build_train_valid_test_datasets
    from megatron.run_configs.data_files import DataFileSettings

    args = global_vars.get_args()
    if args.sft:
        return sft_datasets_provider(train_val_test_num_samples)
    if not (args.data_path or args.train_data_path):
        raise ValueError("pretrain_gpt.py needs --data-path PREFIX (the output prefix of tools/preprocess_data.py, "
                         "e.g. my-gpt2_text_document) or --train-data-path/--valid-data-path/--test-data-path")
    check_data_files(DataFileSettings.from_args(args))  # empty files and token ids outside the vocabulary: one line, before any index build
    return build_train_valid_test_datasets(
        data_prefix=args.data_path,
        data_impl=args.data_impl,
        splits_string=args.split,
        train_valid_test_num_samples=train_val_test_num_samples,
        seq_length=args.seq_length,
        seed=args.seed,
        skip_warmup=not args.mmap_warmup,
        data_cache_path=args.data_cache_path,
        train_data_prefix=args.train_data_path,
        valid_data_prefix=args.valid_data_path,
        test_data_prefix=args.test_data_path,
    )


def sft_datasets_provider(train_val_test_num_samples: list[int]) -> tuple[Any, Any, Any]:
    """--sft: Megatron-LM's SFTDataset over the JSONL files of --data-path (or --train/valid/test-data-path)."""
    args = global_vars.get_args()
    ds_pipe = bool(args.deepspeed) and args.pipeline_model_parallel_size > 1 and not args.no_pipeline_parallel
    check_sft_flags(args.micro_batch_size, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss,
                    deepspeed_pipeline=ds_pipe)
    if not (args.data_path or args.train_data_path):
        raise ValueError("pretrain_gpt.py --sft needs --data-path FILE.jsonl (one {\"messages\": [...]} per line) or "
                         "--train-data-path/--valid-data-path/--test-data-path")
    tokenizer = global_vars.get_tokenizer()
    chat = getattr(tokenizer, "chat", None) or chat_format_for(tokenizer, args.sft_tokenizer_prompt_format)
    builder = SFTBuilder(chat, args.seq_length, args.context_parallel_size)
    return builder.build(train_val_test_num_samples, args.data_path, args.split,
                         (args.train_data_path, args.valid_data_path, args.test_data_path))


MODEL_TYPE = ModelType.encoder_or_decoder
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def main(argv: Optional[list[str]] = None) -> Optional[dict]:
    return pretrain(train_valid_test_datasets_provider, model_provider, MODEL_TYPE, forward_step,
                    args_defaults=ARGS_DEFAULTS, argv=argv)


if __name__ == "__main__":
    exit_on_user_error(main)
