"""MemorySettings: the optional flags megatron/theoretical_memory_usage.py's start-up estimate reads."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional


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
        return cls(
            model_family=getattr(args, "model_family", "gpt"),
            bert_binary_head=bool(getattr(args, "bert_binary_head", True)),
            accumulate_allreduce_grads_in_fp32=bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False)),
            optimizer=getattr(args, "optimizer", "adam"),
            use_distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
            context_parallel_size=getattr(args, "context_parallel_size", 1) or 1,
            distribute_saved_activations=bool(getattr(args, "distribute_saved_activations", False)),
            recompute_granularity=getattr(args, "recompute_granularity", None),
            virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
        )
