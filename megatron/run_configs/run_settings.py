"""Run settings built once from the parsed flags: typed, read-only records that library code takes instead of ``args``.

This is the adapter between Megatron's flat ``argparse`` namespace and typed settings, with megatron/run_configs/:
the records' fields come from the flags with the declared defaults (run_configs/declared.py; a namespace from another
entry script or an older checkpoint may lack them). Start with the training loop's settings (`LoopSettings`); more records (checkpointing,
data, logging, parallelism) follow the same pattern.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """What megatron/training.py's loop reads: length, intervals, exit conditions, skip limits. Build it after the
    model set-up (which turns --train-samples into --train-iters)."""

    train_iters: int
    eval_interval: Optional[int]
    save: Optional[str]
    save_interval: Optional[int]
    load: Optional[str]
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    skip_train: bool = False
    empty_unused_memory_level: int = 0
    log_params_norm: bool = False
    max_skipped_iterations: int = 10
    fp16: bool = False
    loss_scale: Optional[float] = None
    min_loss_scale: float = 1.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoopSettings:
        return fill_from_args(cls, args)  # every field is a flag: its value, or the declared default

    @property
    def loss_scale_floor(self) -> Optional[float]:
        """fp16: the loss scale at which an overflow skip can no longer back off (counts toward the skip limit)."""
        if not self.fp16:
            return None
        return float(self.loss_scale) if self.loss_scale else float(self.min_loss_scale)
