"""Run settings built once from the parsed flags: typed, read-only records that library code takes instead of ``args``.

This is the adapter between Megatron's flat ``argparse`` namespace and typed settings, with megatron/run_configs/:
a record reads the settings groups instantiated from the flags and holds only derived values (run_configs/declared.py;
a namespace from another entry script or an older checkpoint may lack a flag: the declared default). This module
holds the training loop's settings (`LoopSettings`); the other records follow the same pattern.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """What megatron/training.py's loop reads: length, intervals, exit conditions, skip limits. Build it after the
    model set-up (which turns --train-samples into --train-iters)."""

    settings: Settings = dataclasses.field(repr=False)
    train_iters: int  # the run's length once set up (--train-iters, or from --train-samples)

    eval_interval = SettingValue()
    save = SettingValue()
    save_interval = SettingValue()
    load = SettingValue()
    exit_interval = SettingValue()
    exit_duration_in_mins = SettingValue()
    exit_signal_handler = SettingValue()
    skip_train = SettingValue()
    empty_unused_memory_level = SettingValue()
    log_params_norm = SettingValue()
    max_skipped_iterations = SettingValue()
    fp16 = SettingValue()
    loss_scale = SettingValue()
    min_loss_scale = SettingValue()

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> LoopSettings:
        return from_settings(cls, args, settings, train_iters=args.train_iters)

    @property
    def loss_scale_floor(self) -> Optional[float]:
        """fp16: the loss scale at which an overflow skip can no longer back off (counts toward the skip limit)."""
        if not self.fp16:
            return None
        return float(self.loss_scale) if self.loss_scale else float(self.min_loss_scale)
