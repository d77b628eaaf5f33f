"""ThroughputSettings: the model and batch sizes megatron/utils.py's Megatron-DeepSpeed FLOPs estimate reads."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class ThroughputSettings:
    """Batch, sequence (--actual-seq-length wins), model sizes, full recomputation and the world size."""

    micro_batch_size: int
    data_parallel_size: int
    seq_length: int
    hidden_size: int
    num_layers: int
    padded_vocab_size: int
    global_batch_size: Optional[int] = None
    recompute_full: bool = False
    world_size: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ThroughputSettings:
        return cls(
            micro_batch_size=args.micro_batch_size, data_parallel_size=args.data_parallel_size,
            seq_length=getattr(args, "actual_seq_length", None) or args.seq_length,
            hidden_size=args.hidden_size, num_layers=args.num_layers, padded_vocab_size=args.padded_vocab_size,
            global_batch_size=getattr(args, "global_batch_size", None),
            recompute_full=bool(getattr(args, "checkpoint_activations", False)
                                or getattr(args, "recompute_granularity", None) == "full"),
            world_size=getattr(args, "world_size", 1),
        )
