"""Pretrain T5 (Megatron's ``pretrain_t5.py``): same flags, span-corruption data, checkpoints and log lines.

Data: the sentence-level (or document-level) output of ``tools/preprocess_data.py`` with a WordPiece vocabulary
(``--tokenizer-type BertWordPieceLowerCase``, the default here) and ``--vocab-extra-ids 100`` sentinels, e.g.
    python pretrain_t5.py --num-layers 2 --hidden-size 128 --num-attention-heads 4 --kv-channels 32 \
        --ffn-hidden-size 512 --encoder-seq-length 128 --decoder-seq-length 32 --max-position-embeddings 128 \
        --micro-batch-size 8 --train-iters 100 --lr 1e-4 --vocab-file bert-vocab.txt --vocab-extra-ids 100 \
        --data-path my-t5_text_sentence
Loss: the decoder's masked LM loss over the target tokens (``lm loss`` in the log and validation lines).
``--encoder-num-layers`` / ``--decoder-num-layers`` default to ``--num-layers``. Pipeline parallelism follows
Megatron 23.06's ``--pipeline-model-parallel-split-rank R`` scheme (stages 0..R-1 run the encoder, R..P-1 the
decoder; 1F1B only, interleaving is refused); under DeepSpeed, ZeRO 1-3 run without its pipeline engine (PP > 1 with
--deepspeed is refused).
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
from megatron.errors import ArgumentError, exit_on_user_error  # noqa: E402
from megatron.layers import ModelType  # noqa: E402
from megatron.models.t5.model import PP_INTERLEAVED_T5, PP_SPLIT_MISSING, T5Model  # noqa: E402
from megatron.training import pretrain  # noqa: E402
from megatron.utils import average_losses_across_data_parallel_group  # noqa: E402

BATCH_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask", "enc_dec_mask")


def _state() -> ps.ParallelState:
    return ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()


def check_t5_args(args: Any) -> None:
    """One-line refusals for the layouts this build does not run for T5, and the T5-only requirements."""
    pp, split = args.pipeline_model_parallel_size, args.pipeline_model_parallel_split_rank
    if getattr(args, "virtual_pipeline_model_parallel_size", None) is not None:
        raise ArgumentError(PP_INTERLEAVED_T5)
    if pp > 1 and split is None:
        raise ArgumentError(PP_SPLIT_MISSING)
    if split is not None and not 0 < split < pp:
        raise ArgumentError(f"--pipeline-model-parallel-split-rank ({split}) must be in 1..{pp - 1} with "
                            f"--pipeline-model-parallel-size {pp} (stages 0..R-1 run the encoder, R..P-1 the "
                            "decoder)" if pp > 1 else "--pipeline-model-parallel-split-rank needs "
                            "--pipeline-model-parallel-size > 1")
    if pp > 1:
        enc = args.encoder_num_layers or args.num_layers
        dec = args.decoder_num_layers or args.num_layers
        for flag, layers, stages in (("--encoder-num-layers", enc, split), ("--decoder-num-layers", dec, pp - split)):
            if layers % stages:
                raise ArgumentError(f"{flag} ({layers}) must be divisible by its {stages} pipeline stages "
                                    f"(--pipeline-model-parallel-split-rank {split} of "
                                    f"--pipeline-model-parallel-size {pp})")
        if getattr(args, "deepspeed", False):
            raise ArgumentError("T5 pipeline parallelism runs without DeepSpeed (its pipeline engine has no "
                                "encoder-decoder split): drop --deepspeed or use --pipeline-model-parallel-size 1")
    if args.decoder_seq_length is None:
        raise ArgumentError("pretrain_t5.py needs --decoder-seq-length (e.g. 128 with --encoder-seq-length 512)")
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and args.decoder_seq_length % tp:
        raise ArgumentError(f"--sequence-parallel needs --decoder-seq-length ({args.decoder_seq_length}) divisible "
                            f"by --tensor-model-parallel-size ({tp})")
    if not args.vocab_extra_ids:
        raise ArgumentError("pretrain_t5.py needs sentinel tokens for span corruption: add --vocab-extra-ids 100")


def model_provider(pre_process: bool = True, post_process: bool = True) -> T5Model:
    """Build the T5 model."""
    args = global_vars.get_args()
    check_t5_args(args)
    state = _state()
    if state.global_rank == 0:
        print(" > building T5 model ...", flush=True)
    config = core_transformer_config_from_args(args)
    return T5Model(config, pp_state=state, parallel_output=True, pre_process=pre_process,
                   post_process=post_process,
                   fp16_lm_cross_entropy=bool(getattr(args, "fp16_lm_cross_entropy", False)))


def get_batch(data_iterator: Optional[Iterator]) -> tuple[torch.Tensor, ...]:
    """tokens_enc, tokens_dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask of the next micro-batch."""
    args = global_vars.get_args()
    data = next(data_iterator)
    enc, dec, labels, loss_mask, enc_mask, dec_mask, enc_dec_mask = (torch.as_tensor(data[k]).long()
                                                                      for k in BATCH_KEYS)
    batch = (enc, dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask)
    if torch.cuda.is_available() and args.distributed_backend != "gloo":
        device = torch.cuda.current_device()
        batch = tuple(t.cuda(device, non_blocking=True) for t in batch)
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """lm loss: the per-token loss averaged over the target tokens (loss_mask)."""
    loss_mask = loss_mask.float()
    lm_loss = torch.sum(output_tensor.float().view(-1) * loss_mask.reshape(-1)) / loss_mask.sum()
    averaged = average_losses_across_data_parallel_group([lm_loss])
    return lm_loss, {"lm loss": averaged[0]}


def forward_step(data_iterator: Optional[Iterator], model: torch.nn.Module) -> tuple[Any, Any]:
    """Megatron's T5 forward step: (per-token lm loss, loss function)."""
    timers = global_vars.get_timers()
    timers("batch-generator", log_level=2).start()
    enc, dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(enc, dec, enc_mask, dec_mask, enc_dec_mask, tokentype_ids=None, lm_labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples: list[int]) -> tuple[Any, Any, Any]:
    """T5 datasets from --data-path (or separate --train/valid/test-data-path) with Megatron's split."""
    from megatron.data.t5_dataset import build_train_valid_test_datasets

    args = global_vars.get_args()
    if not (args.data_path or args.train_data_path):
        raise ArgumentError("pretrain_t5.py needs --data-path PREFIX (the output prefix of tools/preprocess_data.py, "
                            "e.g. my-t5_text_sentence)")
    return build_train_valid_test_datasets(
        data_prefix=args.data_path,
        data_impl=args.data_impl,
        splits_string=args.split,
        train_valid_test_num_samples=train_val_test_num_samples,
        max_seq_length=args.encoder_seq_length,
        max_seq_length_dec=args.decoder_seq_length,
        masked_lm_prob=args.mask_prob,
        short_seq_prob=args.short_seq_prob,
        seed=args.seed,
        skip_warmup=not args.mmap_warmup,
        tokenizer=global_vars.get_tokenizer(),
        data_cache_path=args.data_cache_path,
        train_data_prefix=args.train_data_path,
        valid_data_prefix=args.valid_data_path,
        test_data_prefix=args.test_data_path,
    )


MODEL_TYPE = ModelType.encoder_and_decoder
ARGS_DEFAULTS = {"tokenizer_type": "BertWordPieceLowerCase", "model_family": "t5"}


def main(argv: Optional[list[str]] = None) -> Optional[dict]:
    return pretrain(train_valid_test_datasets_provider, model_provider, MODEL_TYPE, forward_step,
                    args_defaults=ARGS_DEFAULTS, argv=argv)


if __name__ == "__main__":
    exit_on_user_error(main)
