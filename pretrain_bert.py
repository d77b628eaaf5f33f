"""Pretrain BERT (Megatron's ``pretrain_bert.py``): same flags, data, checkpoints and log lines.

Data: the sentence-level output of ``tools/preprocess_data.py --split-sentences`` with a WordPiece vocabulary
(``--tokenizer-type BertWordPieceLowerCase``, the default here), e.g.
    python pretrain_bert.py --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
        --max-position-embeddings 128 --micro-batch-size 8 --train-iters 100 --lr 1e-4 \
        --vocab-file bert-vocab.txt --data-path my-bert_text_sentence
Loss: masked-LM loss + sentence-order loss (``lm loss`` and ``sop loss`` in the log); ``--bert-no-binary-head``
trains the masked LM alone (no token types, no pooler) and also accepts document-level data.
Every rank builds the same datasets and its data-parallel shard of the sampler, so the ranks of one tensor-parallel
group read the identical micro-batch (Megatron broadcasts it from tensor-parallel rank 0; same result).
"""
from __future__ import annotations

import os
import sys
from functools import partial
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron import global_vars  # noqa: E402
from megatron.arguments import core_transformer_config_from_args  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.errors import ArgumentError, exit_on_user_error  # noqa: E402
from megatron.layers import ModelType  # noqa: E402
from megatron.models.bert.model import BertModel  # noqa: E402
from megatron.training import pretrain  # noqa: E402
from megatron.utils import average_losses_across_data_parallel_group  # noqa: E402

BATCH_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")


def _state() -> ps.ParallelState:
    return ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()


def model_provider(pre_process: bool = True, post_process: bool = True) -> BertModel:
    """Build the BERT model (this rank's pipeline stage)."""
    args = global_vars.get_args()
    state = _state()
    if (getattr(args, "deepspeed", False) and args.pipeline_model_parallel_size > 1
            and not getattr(args, "no_pipeline_parallel", False)):
        raise ArgumentError("pretrain_bert.py has no DeepSpeed pipeline model: with --deepspeed use "
                            "--pipeline-model-parallel-size 1 (or drop --deepspeed to use Megatron's pipeline)")
    if state.global_rank == 0:
        print(" > building BERT model ...", flush=True)
    config = core_transformer_config_from_args(args)
    binary = bool(args.bert_binary_head)
    return BertModel(config, pp_state=state, num_tokentypes=2 if binary else 0, add_binary_head=binary,
                     parallel_output=True, pre_process=pre_process, post_process=post_process,
                     fp16_lm_cross_entropy=bool(getattr(args, "fp16_lm_cross_entropy", False)))


def get_batch(data_iterator: Optional[Iterator]) -> tuple[torch.Tensor, ...]:
    """tokens, types, sentence_order, loss_mask, lm_labels, padding_mask of the next micro-batch (int64)."""
    args = global_vars.get_args()
    data = next(data_iterator)
    tokens, types, labels, is_random, loss_mask, padding_mask = (torch.as_tensor(data[k]).long() for k in BATCH_KEYS)
    batch = (tokens, types, is_random, loss_mask, labels, padding_mask)
    if torch.cuda.is_available() and args.distributed_backend != "gloo":
        device = torch.cuda.current_device()
        batch = tuple(t.cuda(device, non_blocking=True) for t in batch)
    return batch


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor: Any
              ) -> tuple[torch.Tensor, dict[str, Any]]:
    """lm loss (masked mean over the predicted positions) + sop loss (cross entropy, unweighted)."""
    lm_loss_, sop_logits = output_tensor
    lm_loss_ = lm_loss_.float()
    loss_mask = loss_mask.float()
    lm_loss = torch.sum(lm_loss_.view(-1) * loss_mask.reshape(-1)) / loss_mask.sum()
    if sop_logits is None:
        averaged = average_losses_across_data_parallel_group([lm_loss])
        return lm_loss, {"lm loss": averaged[0]}
    sop_loss = F.cross_entropy(sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1)
    averaged = average_losses_across_data_parallel_group([lm_loss, sop_loss])
    return lm_loss + sop_loss, {"lm loss": averaged[0], "sop loss": averaged[1]}


def forward_step(data_iterator: Optional[Iterator], model: torch.nn.Module) -> tuple[Any, Any]:
    """Megatron's BERT forward step: ((per-token lm loss, sop logits), loss function)."""
    args = global_vars.get_args()
    timers = global_vars.get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, sentence_order, loss_mask, lm_labels, padding_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    if not args.bert_binary_head:
        types = None
    output_tensor = model(tokens, padding_mask, tokentype_ids=types, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask, sentence_order)


def train_valid_test_datasets_provider(train_val_test_num_samples: list[int]) -> tuple[Any, Any, Any]:
    """BERT datasets from --data-path (or separate --train/valid/test-data-path) with Megatron's split."""
    from megatron.data.bert_dataset import build_train_valid_test_datasets

    args = global_vars.get_args()
    if not (args.data_path or args.train_data_path):
        raise ArgumentError("pretrain_bert.py needs --data-path PREFIX (the output prefix of tools/preprocess_data.py "
                            "--split-sentences, e.g. my-bert_text_sentence)")
    return build_train_valid_test_datasets(
        data_prefix=args.data_path,
        data_impl=args.data_impl,
        splits_string=args.split,
        train_valid_test_num_samples=train_val_test_num_samples,
        max_seq_length=args.seq_length,
        masked_lm_prob=args.mask_prob,
        short_seq_prob=args.short_seq_prob,
        seed=args.seed,
        skip_warmup=not args.mmap_warmup,
        binary_head=bool(args.bert_binary_head),
        tokenizer=global_vars.get_tokenizer(),
        data_cache_path=args.data_cache_path,
        train_data_prefix=args.train_data_path,
        valid_data_prefix=args.valid_data_path,
        test_data_prefix=args.test_data_path,
    )


MODEL_TYPE = ModelType.encoder_or_decoder
ARGS_DEFAULTS = {"tokenizer_type": "BertWordPieceLowerCase", "model_family": "bert"}


def main(argv: Optional[list[str]] = None) -> Optional[dict]:
    return pretrain(train_valid_test_datasets_provider, model_provider, MODEL_TYPE, forward_step,
                    args_defaults=ARGS_DEFAULTS, argv=argv)


if __name__ == "__main__":
    exit_on_user_error(main)
