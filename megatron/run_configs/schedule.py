"""ScheduleSettings: the learning-rate and weight-decay schedule's flags (megatron/model_setup.py builds the
OptimizerParamScheduler from them; megatron/learning_rates.py runs it)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args


@dataclasses.dataclass(frozen=True)
class ScheduleSettings:
    """LR range, warm-up and decay, the weight-decay increment, the run's length and global batch (iterations are
    converted to samples with it), and whether a checkpoint's schedule wins over the flags."""

    lr: Optional[float] = None
    min_lr: Optional[float] = 0.0
    lr_warmup_init: float = 0.0  # not a flag: a script may set it on args
    lr_decay_style: Optional[str] = "linear"
    lr_decay_iters: Optional[int] = None
    lr_decay_samples: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_iters: Optional[int] = 0
    lr_warmup_samples: Optional[int] = 0
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: Optional[str] = "constant"
    use_checkpoint_opt_param_scheduler: bool = False
    override_opt_param_scheduler: bool = False
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    global_batch_size: Optional[int] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ScheduleSettings:
        return fill_from_args(cls, args, lr_warmup_init=getattr(args, "lr_warmup_init", 0.0) or 0.0)
