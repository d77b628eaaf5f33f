"""ModelWrapSettings: how megatron/model_setup.py builds and wraps the model chunks (precision, DDP)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args


@dataclasses.dataclass(frozen=True)
class ModelWrapSettings:
    """Virtual pipeline chunks, device placement, fp16/bf16 cast and the DDP wrapper's knobs."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    distributed_backend: Optional[str] = None
    fp16: bool = False
    bf16: bool = False
    DDP_impl: str = "local"  # noqa: N815 (Megatron's flag name)
    accumulate_allreduce_grads_in_fp32: bool = False
    use_contiguous_buffers_in_local_ddp: bool = True
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: Optional[int] = None
    data_parallel_random_init: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelWrapSettings:
        return fill_from_args(cls, args)
