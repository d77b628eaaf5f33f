"""ParallelSizes and StartupSettings: what megatron/initialize.py starts torch.distributed and the process groups
from, and seeds with."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    """The tensor/pipeline (and virtual) sizes, the T5 split rank, expert (and expert tensor) and context parallel
    sizes (absent flags: Megatron's defaults)."""

    settings: Settings = dataclasses.field(repr=False)
    virtual_pipeline_model_parallel_size: Optional[int] = None

    pipeline_model_parallel_split_rank = SettingValue()
    expert_model_parallel_size = SettingValue()
    context_parallel_size = SettingValue()
    expert_tensor_parallel_size = SettingValue()
    tensor_model_parallel_size = SettingValue()
    pipeline_model_parallel_size = SettingValue()

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> ParallelSizes:
        return from_settings(cls, args, settings)


@dataclasses.dataclass(frozen=True)
class StartupSettings:
    """The process's start: backend, launcher sizes as parsed, group timeout, determinism, seeds, the CP and EP layout lines."""

    settings: Settings = dataclasses.field(repr=False)
    world_size: int = 1

    distributed_backend = SettingValue()
    local_rank = SettingValue(when_none=0)
    distributed_timeout_minutes = SettingValue()
    deterministic_mode = SettingValue()
    seed = SettingValue()
    data_parallel_random_init = SettingValue()
    seq_length = SettingValue()
    cp_comm_type = SettingValue()
    num_experts = SettingValue()  # the EP layout line

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> StartupSettings:
        return from_settings(cls, args, settings)
