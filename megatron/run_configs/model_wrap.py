"""ModelWrapSettings: how megatron/model_setup.py builds and wraps the model chunks (precision, DDP)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional


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
        return cls(
            virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
            distributed_backend=getattr(args, "distributed_backend", None),
            fp16=bool(args.fp16), bf16=bool(args.bf16), DDP_impl=args.DDP_impl,
            accumulate_allreduce_grads_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32),
            use_contiguous_buffers_in_local_ddp=bool(getattr(args, "use_contiguous_buffers_in_local_ddp", True)),
            overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
            use_distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
            overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
            ddp_bucket_size=getattr(args, "ddp_bucket_size", None),
            data_parallel_random_init=bool(getattr(args, "data_parallel_random_init", False)),
        )
