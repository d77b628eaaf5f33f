"""DeepSpeedSettings: what the DeepSpeed glue (megatron/ds/, megatron/backend/deepspeed.py) reads from the flags."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class DeepSpeedSettings:
    """The resolved DeepSpeed config, DeepSpeed activation checkpointing (and the layers it counts), the
    pipeline-engine choice, the pipe batches' mask flags and the steps' timer barrier (the batch shape: BatchSettings)."""

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
    reset_position_ids: bool = False
    eod_mask_loss: bool = False
    num_layers: Optional[int] = None
    barrier_with_L1_time: bool = True  # noqa: N815 (Megatron's flag name)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DeepSpeedSettings:
        return cls(
            enabled=bool(getattr(args, "deepspeed", False)),
            config_dict=getattr(args, "deepspeed_config_dict", None),
            deepspeed_activation_checkpointing=bool(getattr(args, "deepspeed_activation_checkpointing", False)),
            partition_activations=bool(getattr(args, "partition_activations", False)),
            contigious_checkpointing=bool(getattr(args, "contigious_checkpointing", False)),
            checkpoint_in_cpu=bool(getattr(args, "checkpoint_in_cpu", False)),
            synchronize_each_layer=bool(getattr(args, "synchronize_each_layer", False)),
            profile_backward=bool(getattr(args, "profile_backward", False)),
            no_pipeline_parallel=bool(getattr(args, "no_pipeline_parallel", False)),
            model_family=getattr(args, "model_family", "gpt"),
            fp16_lm_cross_entropy=bool(getattr(args, "fp16_lm_cross_entropy", False)),
            reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
            reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
            eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
            num_layers=getattr(args, "num_layers", None),
            barrier_with_L1_time=bool(getattr(args, "barrier_with_L1_time", True)),
        )
