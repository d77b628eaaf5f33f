"""StepSettings: what a training backend's train/eval step reads from the flags beyond the batch shape."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The step's schedule, timer barriers, sequence-parallel grads, the NaN check and per-token loss."""

    settings: Settings = dataclasses.field(repr=False)
    virtual_pipeline_model_parallel_size: Optional[int] = None

    pipeline_model_parallel_size = SettingValue()
    decoder_seq_length = SettingValue()
    sequence_parallel = SettingValue()
    check_for_nan_in_loss_and_grad = SettingValue()
    barrier_with_L1_time = SettingValue()  # noqa: N815 (Megatron's flag name)
    calculate_per_token_loss = SettingValue()

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> StepSettings:
        return from_settings(cls, args, settings)
