"""--loader deepspeed: a DeepSpeed ``global_stepN`` folder (ZeRO 0-3, pipeline engine, any TP) streamed layer by
layer through megatron/checkpoint_conversion/deepspeed_format.py (rank files memory-mapped; a ZeRO-3 checkpoint is
consolidated one tensor rank at a time with DeepSpeed's zero_to_fp32)."""
from __future__ import annotations

import argparse
from typing import Iterator, Tuple

from megatron.checkpoint_conversion.interchange import Message, ModelMeta


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DeepSpeed loader")
    group.add_argument("--iteration", type=int, default=None,
                       help="Read global_step{N} instead of the tag named by 'latest'")


def load_checkpoint(args: argparse.Namespace) -> Tuple[ModelMeta, Iterator[Message]]:
    from megatron.checkpoint_conversion.deepspeed_format import read_deepspeed

    return read_deepspeed(args.load_dir, iteration=args.iteration, true_vocab_size=args.true_vocab_size,
                          model_type=args.model_type, trust=bool(args.trust_checkpoint),
                          optimizer=bool(getattr(args, "keep_training_state", False)))
