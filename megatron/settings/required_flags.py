"""Every missing required flag in one line, checked first in argument validation (before anything is built).

A newcomer who leaves out several flags learns them all from one run instead of one per run. Training-only flags
(`--train-iters`/`--train-samples`, a data path, `--lr`) are required when the entry point trains: `pretrain()` marks
its validation with the `TRAINING_RUN` key in `args_defaults`.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Sequence

from megatron.errors import ArgumentError

TRAINING_RUN = "_training_run"  # args_defaults key set by megatron.training.pretrain (never a flag)


def missing_required_flags(args: argparse.Namespace, training: bool,
                           tokenizer_flags: Dict[str, Sequence[str]]) -> List[str]:
    """The required flags that `args` lacks, as the user would type them (with alternatives in parentheses)."""
    missing = []
    if getattr(args, "micro_batch_size", None) is None:
        missing.append("--micro-batch-size")
    for flag in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(args, flag, None) is None:
            missing.append("--" + flag.replace("_", "-"))
    if getattr(args, "seq_length", None) is None and getattr(args, "encoder_seq_length", None) is None:
        missing.append("--seq-length")
    if (getattr(args, "max_position_embeddings", None) is None
            and getattr(args, "position_embedding_type", "learned_absolute") not in ("rope", "rotary", "alibi", "none")):
        missing.append("--max-position-embeddings")
    kind = getattr(args, "tokenizer_type", None)
    for flag in tokenizer_flags.get(kind, ()):
        if getattr(args, flag, None) is None:
            missing.append(f"--{flag.replace('_', '-')} (for --tokenizer-type {kind})")
    if training:
        if getattr(args, "train_iters", None) is None and getattr(args, "train_samples", None) is None:
            missing.append("--train-iters (or --train-samples)")
        if not getattr(args, "data_path", None) and not getattr(args, "train_data_path", None):
            missing.append("--data-path (or --train-data-path)")
        if getattr(args, "lr", None) is None and not getattr(args, "skip_train", False):
            missing.append("--lr")
    return missing


def check_required_flags(args: argparse.Namespace, training: bool,
                         tokenizer_flags: Dict[str, Sequence[str]]) -> None:
    """Raise one ArgumentError naming every missing required flag."""
    missing = missing_required_flags(args, training, tokenizer_flags)
    if missing:
        raise ArgumentError(f"missing required flag{'s' if len(missing) > 1 else ''}: {', '.join(missing)}")
