"""Build this rank's model chunks and the learning-rate / weight-decay scheduler from the flags.

Below `megatron.training` (which runs the loop) and `megatron.ds.engine` (DeepSpeed's engine), which both use it, so
that neither imports the other.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from megatron import fused_kernels, global_vars
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.learning_rates import OptimizerParamScheduler
from megatron.logging_utils import print_rank_0
from megatron.model.module import Float16Module
from megatron.run_configs.model_wrap import ModelWrapSettings


def get_model(model_provider_func: Callable, model_type: Any, args: argparse.Namespace,
              state: ps.ParallelState, wrap_with_ddp: bool = True) -> list[torch.nn.Module]:
    """Megatron's ``get_model``: `build_model` with the wrapping settings from ``args`` (which records
    ``model_type``, as Megatron's does)."""
    args.model_type = model_type
    return build_model(model_provider_func, model_type, ModelWrapSettings.from_args(args), state, args,
                       wrap_with_ddp)


def build_model(model_provider_func: Callable, model_type: Any, wrap: ModelWrapSettings, state: ps.ParallelState,
                kernels: Any, wrap_with_ddp: bool = True) -> list[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage), cast for fp16/bf16, wrap each in DDP.
    `kernels`: the model's config (or flags) the fused-kernels start-up line describes."""
    vp_size = wrap.virtual_pipeline_model_parallel_size
    chunks = []
    if state.pp_size > 1 and vp_size is not None:
        for vp_rank in range(vp_size):
            state.set_virtual_pipeline_model_parallel_rank(vp_rank)
            chunks.append(model_provider_func(pre_process=state.is_pipeline_first_stage(),
                                              post_process=state.is_pipeline_last_stage()))
        state.set_virtual_pipeline_model_parallel_rank(0)
    else:
        chunks.append(model_provider_func(pre_process=state.is_pipeline_first_stage(),
                                          post_process=state.is_pipeline_last_stage()))
    for chunk in chunks:
        chunk.model_type = model_type
        for param in chunk.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    n_params = sum(p.nelement() for chunk in chunks for p in chunk.parameters())
    print_rank_0(fused_kernels.describe(kernels))
    if state.dp_rank == 0:
        print(f" > number of parameters on (tensor, pipeline) model parallel rank ({state.tp_rank}, "
              f"{state.pp_rank}): {n_params}", flush=True)
    return [_wrap_chunk(chunk, wrap, state, wrap_with_ddp) for chunk in chunks]


def _wrap_chunk(model: torch.nn.Module, wrap: ModelWrapSettings, state: ps.ParallelState,
                wrap_with_ddp: bool) -> torch.nn.Module:
    if torch.cuda.is_available() and wrap.distributed_backend != "gloo":
        model.cuda(torch.cuda.current_device())
    if wrap.fp16 or wrap.bf16:
        model = Float16Module(model, torch.half if wrap.fp16 else torch.bfloat16)
    if wrap_with_ddp:
        from megatron.core.distributed import DistributedDataParallel, TorchDistributedDataParallel

        if wrap.DDP_impl == "torch":
            if state.expert_groups:
                raise ValueError("--DDP-impl torch cannot reduce expert grads over the expert-data-parallel group; "
                                 "use --DDP-impl local with --expert-model-parallel-size > 1")
            model = TorchDistributedDataParallel(model, dp_group=state.dp_cp_group)  # DP x CP: gradients
        else:
            model = DistributedDataParallel(
                model, dp_group=state.dp_cp_group,  # context-parallel ranks hold parts of the same gradient
                accumulate_allreduce_grads_in_fp32=wrap.accumulate_allreduce_grads_in_fp32,
                use_contiguous_buffers=wrap.use_contiguous_buffers_in_local_ddp,
                overlap_grad_reduce=wrap.overlap_grad_reduce,
                use_distributed_optimizer=wrap.use_distributed_optimizer,
                overlap_param_gather=wrap.overlap_param_gather,
                bucket_size=wrap.ddp_bucket_size,
                expert_dp_group=state.edp_group if state.expert_groups else None,
            )
            if wrap.data_parallel_random_init:
                model.broadcast_params()  # start every data-parallel replica from DP rank 0's weights
    return model


def _scheduler_steps(args: argparse.Namespace) -> tuple[int, int, int]:
    """(warmup, decay, wd increment) lengths in samples, converted from iterations like Megatron."""
    if args.train_iters:
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        decay = args.lr_decay_iters * args.global_batch_size
        wd_incr = args.train_iters * args.global_batch_size
        warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                  else args.lr_warmup_iters * args.global_batch_size)
    elif args.train_samples:
        update_train_iters(args)
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        decay = args.lr_decay_samples
        wd_incr = args.train_samples
        warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                  else args.lr_warmup_samples)
    else:
        raise ValueError("pass --train-iters or --train-samples")
    return int(warmup), int(decay), int(wd_incr)


def get_optimizer_param_scheduler(optimizer: Any, args: argparse.Namespace) -> OptimizerParamScheduler:
    warmup, decay, wd_incr = _scheduler_steps(args)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=getattr(args, "lr_warmup_init", 0.0) or 0.0,  # not a flag: a script may set it
        max_lr=args.lr if args.lr is not None else 0.0,  # no --lr: only with --skip-train (never stepped)
        min_lr=args.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=wd_incr,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def update_train_iters(args: argparse.Namespace) -> None:
    """--train-samples → args.train_iters (accounting for batch-size ramp-up), as Megatron."""
    if args.rampup_batch_size is None:
        args.train_iters = args.train_samples // args.global_batch_size
    else:
        iterations = 0
        consumed = 0
        while consumed <= int(args.rampup_batch_size[2]) and consumed < args.train_samples:
            global_vars.update_num_microbatches(consumed, consistency_check=False)
            consumed += global_vars.get_current_global_batch_size()
            iterations += 1
        global_vars.update_num_microbatches(0, consistency_check=False)
        iterations += max(0, args.train_samples - consumed) // args.global_batch_size
        args.train_iters = iterations
    print_rank_0(f"setting training iterations to {args.train_iters}")
