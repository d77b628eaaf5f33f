"""StepSettings: what a training backend's train/eval step reads from the flags beyond the batch shape."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The step's schedule, timer barriers, sequence-parallel grads and the NaN check."""

    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    decoder_seq_length: Optional[int] = None
    sequence_parallel: bool = False
    check_for_nan_in_loss_and_grad: bool = True
    barrier_with_L1_time: bool = True  # noqa: N815 (Megatron's flag name)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StepSettings:
        return fill_from_args(cls, args)
