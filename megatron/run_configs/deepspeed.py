"""DeepSpeedSettings: what the DeepSpeed glue (megatron/ds/, megatron/backend/deepspeed.py) reads from the flags."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

from megatron.run_configs.declared import fill_from_args, flag_value


@dataclasses.dataclass(frozen=True)
class DeepSpeedSettings:
    """The resolved DeepSpeed config, DeepSpeed activation checkpointing and the pipeline-engine choice."""

    enabled: bool = False
    config_dict: Optional[dict[str, Any]] = None  # set by megatron/ds/config.py during validate_args
    deepspeed_activation_checkpointing: bool = False
    partition_activations: bool = False
    contigious_checkpointing: bool = False  # Megatron-DeepSpeed's spelling of the flag
    checkpoint_in_cpu: bool = False
    synchronize_each_layer: bool = False
    profile_backward: bool = False
    no_pipeline_parallel: bool = False
    model_family: str = "gpt"
    fp16_lm_cross_entropy: bool = False
    reset_attention_mask: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DeepSpeedSettings:
        return fill_from_args(cls, args, enabled=bool(flag_value(args, "deepspeed")),
                              config_dict=getattr(args, "deepspeed_config_dict", None))
