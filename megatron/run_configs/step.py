"""StepSettings: what a training backend's train/eval step reads from the flags beyond the batch shape."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional


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
        return cls(
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
            decoder_seq_length=getattr(args, "decoder_seq_length", None),
            sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
            check_for_nan_in_loss_and_grad=bool(getattr(args, "check_for_nan_in_loss_and_grad", True)),
            barrier_with_L1_time=bool(getattr(args, "barrier_with_L1_time", True)),
        )
