"""Learning-rate and weight-decay schedule (Megatron's OptimizerParamScheduler).

Steps are counted in samples (training calls `step(global_batch_size)` per iteration). LR: linear warmup from
`init_lr` to `max_lr` over `lr_warmup_steps`, then constant / linear / cosine / inverse-square-root decay to `min_lr`
at `lr_decay_steps`, or WSD (warmup-stable-decay): `max_lr` until `lr_decay_steps - wsd_decay_steps`, then an
exponential / linear / cosine / minus_sqrt anneal to `min_lr` over the last `wsd_decay_steps`. Weight decay: constant / linear / cosine increment from `start_wd` to `end_wd` over
`wd_incr_steps`. Each param group gets `lr * lr_mult` and `wd * wd_mult`.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from megatron.core.rank_print import print_rank_0 as _print_rank_0
from megatron.errors import MegatronUserError

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def wsd_anneal_coeff(style: str, ratio: float) -> float:
    """Megatron's WSD anneal: the fraction of (max_lr - min_lr) left at `ratio` (0..1) of the decay phase."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return (2.0 * math.pow(0.5, ratio)) - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt

def _check_wsd(style: str, wsd_decay_steps: Optional[int], wsd_style: Optional[str]) -> None:
    """One-line errors for a WSD schedule Megatron would trip an assert (or divide by zero) on."""
    if style != "WSD":
        return
    if wsd_decay_steps is None:
        raise ValueError("--lr-decay-style WSD needs the length of its decay phase: pass --lr-wsd-decay-iters "
                         "(with --train-iters) or --lr-wsd-decay-samples (with --train-samples)")
    if wsd_decay_steps <= 0:
        raise ValueError(f"the WSD decay phase ({wsd_decay_steps} samples) must be > 0: raise "
                         "--lr-wsd-decay-iters/--lr-wsd-decay-samples")
    if wsd_style not in LR_WSD_DECAY_STYLES:
        raise ValueError(f"--lr-wsd-decay-style {wsd_style!r} is not one of {', '.join(LR_WSD_DECAY_STYLES)}")


class SchedulerMismatchError(MegatronUserError, ValueError):
    """Resuming with flags whose learning-rate schedule differs from the checkpoint's."""


class OptimizerParamScheduler:
    """Sets `lr` and `weight_decay` of every optimizer param group from the number of samples seen."""

    def __init__(
        self,
        optimizer: Any,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        if self.min_lr < 0.0:
            raise ValueError(f"--min-lr ({min_lr}) must be >= 0")
        if self.max_lr < self.min_lr:
            raise ValueError(f"--lr ({max_lr}) must be >= --min-lr ({min_lr})")
        if self.init_lr > self.max_lr:
            raise ValueError(f"initial warmup lr ({init_lr}) must be <= --lr ({max_lr})")
        if lr_decay_steps <= 0:
            raise ValueError(
                f"lr decay steps ({lr_decay_steps}) must be > 0: set --lr-decay-iters/--lr-decay-samples or "
                "--train-iters/--train-samples"
            )
        if lr_warmup_steps >= lr_decay_steps:
            raise ValueError(
                f"lr warmup steps ({lr_warmup_steps}) must be smaller than lr decay steps ({lr_decay_steps}); "
                "lower --lr-warmup-iters/--lr-warmup-fraction or raise --lr-decay-iters"
            )
        if lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}")
        _check_wsd(lr_decay_style, wsd_decay_steps, lr_wsd_decay_style)
        if start_wd < 0.0:
            raise ValueError(f"--start-weight-decay ({start_wd}) must be >= 0")
        if end_wd < start_wd:
            raise ValueError(f"--end-weight-decay ({end_wd}) must be >= --start-weight-decay ({start_wd})")
        if wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"--weight-decay-incr-style {wd_incr_style!r} is not one of {', '.join(WD_INCR_STYLES)}")
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError(
                f"--weight-decay-incr-style constant needs --start-weight-decay ({start_wd}) == "
                f"--end-weight-decay ({end_wd})"
            )
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "both --override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are set; pick one"
            )
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.num_steps = 0
        self.step(0)
        _print_rank_0(f"> learning rate decay style: {self.lr_decay_style}")

    def get_wd(self) -> float:
        """Weight decay at the current step."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        delta_wd = self.end_wd - self.start_wd
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * delta_wd

    def get_lr(self) -> float:
        """Learning rate at the current step."""
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.lr_decay_steps:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            return max(self.min_lr, self.max_lr * warmup_steps**0.5 / (num_steps**0.5))
        decay_ratio = float(self.num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        delta_lr = self.max_lr - self.min_lr
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "WSD":
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                coeff = 1.0
            else:
                ratio = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
                coeff = wsd_anneal_coeff(self.lr_wsd_decay_style, ratio)
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coeff * delta_lr

    def step(self, increment: int) -> None:
        """Advance by `increment` samples and set lr / weight decay on every param group."""
        self.num_steps += increment
        new_lr = self.get_lr()
        new_wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = new_lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = new_wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value: Any, sd_value: Any, name: str) -> Any:
        """Megatron's rule: override → keep the flag value; else the checkpoint value (which must match the flag
        unless --use-checkpoint-opt_param-scheduler)."""
        if self.override_opt_param_scheduler:
            _print_rank_0(f" > overriding {name} value to {cls_value}")
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            why = (" (samples = iterations x --global-batch-size: a changed --train-iters, --lr-decay-iters or "
                   "--lr-warmup-* changes them)") if "samples" in name else ""
            raise SchedulerMismatchError(
                f"the checkpoint's learning-rate schedule has {name} {sd_value} but this run's flags give "
                f"{cls_value}{why}: keep the checkpoint's flags, or pass --override-opt_param-scheduler (use this run's schedule) or "
                "--use-checkpoint-opt_param-scheduler (keep the checkpoint's)"
            )
        _print_rank_0(f" > using checkpoint value {sd_value} for {name}")
        return sd_value

    def load_state_dict(self, sd: dict) -> None:
        """Restore from `state_dict()` output (also accepts Megatron's older key names)."""
        max_lr = sd["start_lr"] if "start_lr" in sd else sd["max_lr"]
        self.max_lr = self._check_and_set(self.max_lr, max_lr, "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, sd["min_lr"], "minimum learning rate")
        warmup = sd.get("warmup_iter", sd.get("warmup_steps", sd.get("lr_warmup_steps")))
        self.lr_warmup_steps = self._check_and_set(self.lr_warmup_steps, warmup, "warmup samples")
        decay = sd.get("end_iter", sd.get("decay_steps", sd.get("lr_decay_steps")))
        self.lr_decay_steps = self._check_and_set(self.lr_decay_steps, decay, "decay samples")
        style = sd["decay_style"] if "decay_style" in sd else sd["lr_decay_style"]
        self.lr_decay_style = self._check_and_set(self.lr_decay_style, style, "learning rate decay style")
        num_steps = sd["num_iters"] if "num_iters" in sd else sd["num_steps"]
        if "start_wd" in sd:
            self.start_wd = self._check_and_set(self.start_wd, sd["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, sd["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(
                self.wd_incr_steps, sd["wd_incr_steps"], "weight-decay increment samples"
            )
            self.wd_incr_style = self._check_and_set(self.wd_incr_style, sd["wd_incr_style"], "weight decay incr style")
        self.num_steps = 0
        self.step(increment=num_steps)
