"""MemorySettings: the optional flags megatron/theoretical_memory_usage.py's start-up estimate reads."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args


@dataclasses.dataclass(frozen=True)
class MemorySettings:
    """Model family, optimizer, precision and recompute choices the estimate depends on (absent flags: defaults)."""

    model_family: str = "gpt"
    bert_binary_head: bool = True
    accumulate_allreduce_grads_in_fp32: bool = False
    optimizer: str = "adam"
    use_distributed_optimizer: bool = False
    context_parallel_size: int = 1
    distribute_saved_activations: bool = False
    recompute_granularity: Optional[str] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MemorySettings:
        return fill_from_args(cls, args)
