"""ThroughputSettings: the model and batch sizes megatron/utils.py's Megatron-DeepSpeed FLOPs estimate reads."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, flag_value, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class ThroughputSettings:
    """Batch, sequence (--actual-seq-length wins), model sizes, full recomputation and the world size."""

    settings: Settings = dataclasses.field(repr=False)
    data_parallel_size: int
    padded_vocab_size: int
    seq_length: int  # --actual-seq-length (Megatron-DeepSpeed's, no flag) or --seq-length
    recompute_full: bool = False
    world_size: int = 1

    micro_batch_size = SettingValue()
    hidden_size = SettingValue()
    num_layers = SettingValue()
    global_batch_size = SettingValue()

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> ThroughputSettings:
        return from_settings(
            cls, args, settings,
            seq_length=getattr(args, "actual_seq_length", None) or args.seq_length,
            recompute_full=bool(flag_value(args, "checkpoint_activations")
                                or flag_value(args, "recompute_granularity") == "full"),
        )
