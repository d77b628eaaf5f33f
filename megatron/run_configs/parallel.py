"""ParallelSizes: the optional parallel sizes megatron/initialize.py builds the process groups from."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    """The T5 split rank, expert (and expert tensor) and context parallel sizes (absent flags: Megatron's defaults)."""

    pipeline_model_parallel_split_rank: Optional[int] = None
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ParallelSizes:
        return fill_from_args(cls, args)
