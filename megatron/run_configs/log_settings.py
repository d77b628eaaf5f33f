"""LogSettings: which TensorBoard scalars are written and which FLOPs formula the log line uses."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class LogSettings:
    """The --log-*-to-tensorboard switches (Megatron's defaults for absent ones), the model family and the world size
    (the "world-size" scalar)."""

    settings: Settings = dataclasses.field(repr=False)
    model_family: str = "gpt"
    world_size: int = 1

    log_learning_rate_to_tensorboard = SettingValue()
    log_batch_size_to_tensorboard = SettingValue()
    log_loss_scale_to_tensorboard = SettingValue()
    log_world_size_to_tensorboard = SettingValue()
    log_memory_to_tensorboard = SettingValue()
    log_validation_ppl_to_tensorboard = SettingValue()
    log_timers_to_tensorboard = SettingValue()
    log_straggler = SettingValue()  # megatron/straggler.py: the straggler detector
    disable_straggler_on_startup = SettingValue()
    straggler_ctrlr_port = SettingValue()
    straggler_minmax_count = SettingValue()
    straggler_threshold = SettingValue()

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> LogSettings:
        return from_settings(cls, args, settings)
