"""ParallelSizes and StartupSettings: what megatron/initialize.py starts torch.distributed and the process groups
from, and seeds with."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    """The tensor/pipeline (and virtual) sizes, the T5 split rank, expert (and expert tensor) and context parallel
    sizes (absent flags: Megatron's defaults)."""

    pipeline_model_parallel_split_rank: Optional[int] = None
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ParallelSizes:
        return cls(
            pipeline_model_parallel_split_rank=getattr(args, "pipeline_model_parallel_split_rank", None),
            expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1) or 1,
            context_parallel_size=getattr(args, "context_parallel_size", 1),
            expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
            tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
            pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", 1),
            virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
        )


@dataclasses.dataclass(frozen=True)
class StartupSettings:
    """The process's start: backend, launcher sizes as parsed, group timeout, determinism, seeds, the CP layout line."""

    distributed_backend: Optional[str] = None
    world_size: int = 1
    local_rank: int = 0
    distributed_timeout_minutes: int = 10
    deterministic_mode: bool = False
    seed: int = 1234
    data_parallel_random_init: bool = False
    seq_length: Optional[int] = None
    cp_comm_type: str = "p2p"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StartupSettings:
        return cls(
            distributed_backend=getattr(args, "distributed_backend", None),
            world_size=getattr(args, "world_size", 1),
            local_rank=getattr(args, "local_rank", 0),
            distributed_timeout_minutes=getattr(args, "distributed_timeout_minutes", 10),
            deterministic_mode=bool(getattr(args, "deterministic_mode", False)),
            seed=getattr(args, "seed", 1234),
            data_parallel_random_init=bool(getattr(args, "data_parallel_random_init", False)),
            seq_length=getattr(args, "seq_length", None),
            cp_comm_type=getattr(args, "cp_comm_type", "p2p"),
        )
