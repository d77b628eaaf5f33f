"""ThroughputSettings: the model and batch sizes megatron/utils.py's Megatron-DeepSpeed FLOPs estimate reads."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args, flag_value


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
        return fill_from_args(
            cls, args,
            seq_length=getattr(args, "actual_seq_length", None) or args.seq_length,  # Megatron-DeepSpeed's, no flag
            recompute_full=bool(flag_value(args, "checkpoint_activations")
                                or flag_value(args, "recompute_granularity") == "full"),
        )
