"""DeepSpeedSettings: what the DeepSpeed glue (megatron/ds/, megatron/backend/deepspeed.py) reads from the flags."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

from megatron.run_configs.declared import SettingValue, flag_value, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class DeepSpeedSettings:
    """The resolved DeepSpeed config, DeepSpeed activation checkpointing (and the layers it counts), the
    pipeline-engine choice, the pipe batches' mask flags and the steps' timer barrier (the batch shape: BatchSettings)."""

    settings: Settings = dataclasses.field(repr=False)
    enabled: bool = False  # --deepspeed
    config_dict: Optional[dict[str, Any]] = None  # set by megatron/ds/config.py during validate_args
    model_family: str = "gpt"

    deepspeed_activation_checkpointing = SettingValue()
    partition_activations = SettingValue()
    contigious_checkpointing = SettingValue()  # Megatron-DeepSpeed's spelling of the flag
    checkpoint_in_cpu = SettingValue()
    synchronize_each_layer = SettingValue()
    profile_backward = SettingValue()
    no_pipeline_parallel = SettingValue()
    fp16_lm_cross_entropy = SettingValue()
    reset_attention_mask = SettingValue()
    reset_position_ids = SettingValue()
    eod_mask_loss = SettingValue()
    num_layers = SettingValue()
    barrier_with_L1_time = SettingValue()  # noqa: N815 (Megatron's flag name)

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> DeepSpeedSettings:
        return from_settings(cls, args, settings, enabled=bool(flag_value(args, "deepspeed")),
                             config_dict=getattr(args, "deepspeed_config_dict", None))
