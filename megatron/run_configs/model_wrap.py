"""ModelWrapSettings: how megatron/model_setup.py builds and wraps the model chunks (precision, DDP)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class ModelWrapSettings:
    """Virtual pipeline chunks, device placement, fp16/bf16 cast and the DDP wrapper's knobs."""

    settings: Settings = dataclasses.field(repr=False)
    virtual_pipeline_model_parallel_size: Optional[int] = None

    distributed_backend = SettingValue()
    fp16 = SettingValue()
    bf16 = SettingValue()
    DDP_impl = SettingValue()  # noqa: N815 (Megatron's flag name)
    accumulate_allreduce_grads_in_fp32 = SettingValue()
    use_contiguous_buffers_in_local_ddp = SettingValue()
    overlap_grad_reduce = SettingValue()
    use_distributed_optimizer = SettingValue()
    overlap_param_gather = SettingValue()
    ddp_bucket_size = SettingValue()
    data_parallel_random_init = SettingValue()

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> ModelWrapSettings:
        return from_settings(cls, args, settings)
