"""LogSettings: which TensorBoard scalars are written and which FLOPs formula the log line uses."""
from __future__ import annotations

import argparse
import dataclasses

from megatron.run_configs.declared import fill_from_args


@dataclasses.dataclass(frozen=True)
class LogSettings:
    """The --log-*-to-tensorboard switches (Megatron's defaults for absent ones) and the model family."""

    log_learning_rate_to_tensorboard: bool = True
    log_batch_size_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    log_world_size_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_timers_to_tensorboard: bool = False
    model_family: str = "gpt"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LogSettings:
        return fill_from_args(cls, args)
