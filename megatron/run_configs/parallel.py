"""ParallelSizes and StartupSettings: what megatron/initialize.py starts torch.distributed and the process groups
from, and seeds with."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args


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
        return fill_from_args(cls, args)


@dataclasses.dataclass(frozen=True)
class StartupSettings:
    """The process's start: backend, launcher sizes as parsed, group timeout, determinism, seeds, the CP and EP layout lines."""

    distributed_backend: Optional[str] = None
    world_size: int = 1
    local_rank: int = 0
    distributed_timeout_minutes: int = 10
    deterministic_mode: bool = False
    seed: int = 1234
    data_parallel_random_init: bool = False
    seq_length: Optional[int] = None
    cp_comm_type: str = "p2p"
    num_experts: Optional[int] = None  # the EP layout line

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StartupSettings:
        return fill_from_args(cls, args)
