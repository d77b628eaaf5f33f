"""ScheduleSettings: the learning-rate and weight-decay schedule's flags (megatron/model_setup.py builds the
OptimizerParamScheduler from them; megatron/learning_rates.py runs it)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class ScheduleSettings:
    """LR range, warm-up and decay, the weight-decay increment, the run's length and global batch (iterations are
    converted to samples with it), and whether a checkpoint's schedule wins over the flags."""

    settings: Settings = dataclasses.field(repr=False)
    lr_warmup_init: float = 0.0  # not a flag: a script may set it on args

    lr = SettingValue()
    min_lr = SettingValue()
    lr_decay_style = SettingValue()
    lr_wsd_decay_style = SettingValue()
    lr_wsd_decay_iters = SettingValue()
    lr_wsd_decay_samples = SettingValue()
    lr_decay_iters = SettingValue()
    lr_decay_samples = SettingValue()
    lr_warmup_fraction = SettingValue()
    lr_warmup_iters = SettingValue()
    lr_warmup_samples = SettingValue()
    start_weight_decay = SettingValue()
    end_weight_decay = SettingValue()
    weight_decay_incr_style = SettingValue()
    use_checkpoint_opt_param_scheduler = SettingValue()
    override_opt_param_scheduler = SettingValue()
    train_iters = SettingValue()
    train_samples = SettingValue()
    global_batch_size = SettingValue()

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> ScheduleSettings:
        return from_settings(cls, args, settings, lr_warmup_init=getattr(args, "lr_warmup_init", 0.0) or 0.0)
