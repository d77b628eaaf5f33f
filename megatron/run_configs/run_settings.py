"""Run settings built once from the parsed flags: typed, read-only records that library code takes instead of ``args``.

This is the adapter between Megatron's flat ``argparse`` namespace and typed settings: the only place that reads
optional flags with their defaults (``getattr(args, name, default)``: a namespace from another entry script or an
older checkpoint may lack them). Start with the training loop's settings (`LoopSettings`); more records (checkpointing,
data, logging, parallelism) follow the same pattern.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional


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
        return cls(
            train_iters=args.train_iters, eval_interval=args.eval_interval, save=args.save,
            save_interval=args.save_interval, load=args.load,
            exit_interval=getattr(args, "exit_interval", None),
            exit_duration_in_mins=getattr(args, "exit_duration_in_mins", None),
            exit_signal_handler=bool(getattr(args, "exit_signal_handler", False)),
            skip_train=bool(getattr(args, "skip_train", False)),
            empty_unused_memory_level=getattr(args, "empty_unused_memory_level", 0),
            log_params_norm=bool(getattr(args, "log_params_norm", False)),
            max_skipped_iterations=getattr(args, "max_skipped_iterations", 10),
            fp16=bool(args.fp16), loss_scale=args.loss_scale,
            min_loss_scale=getattr(args, "min_loss_scale", 1.0),
        )

    @property
    def loss_scale_floor(self) -> Optional[float]:
        """fp16: the loss scale at which an overflow skip can no longer back off (counts toward the skip limit)."""
        if not self.fp16:
            return None
        return float(self.loss_scale) if self.loss_scale else float(self.min_loss_scale)
