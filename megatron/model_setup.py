"""Build this rank's model chunks and the learning-rate / weight-decay scheduler from the flags.

Below `megatron.training` (which runs the loop) and `megatron.ds.engine` (DeepSpeed's engine), which both use it, so
that neither imports the other.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

import torch

from megatron import fused_kernels, global_vars
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, TorchDistributedDataParallel
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.layers.module import Float16Module
from megatron.learning_rates import OptimizerParamScheduler
from megatron.logging_utils import print_rank_0
from megatron.run_configs.model_wrap import ModelWrapSettings
from megatron.run_configs.schedule import ScheduleSettings


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


def scheduler_steps(schedule: ScheduleSettings) -> tuple[int, int, int]:
    """(warmup, decay, wd increment) lengths in samples, converted from iterations like Megatron (--lr-decay-iters
    defaults to --train-iters, --lr-decay-samples to --train-samples)."""
    s = schedule
    if s.train_iters:
        decay = (s.lr_decay_iters if s.lr_decay_iters is not None else s.train_iters) * s.global_batch_size
        wd_incr = s.train_iters * s.global_batch_size
        warmup = (s.lr_warmup_fraction * decay if s.lr_warmup_fraction is not None
                  else s.lr_warmup_iters * s.global_batch_size)
    elif s.train_samples:
        decay = s.lr_decay_samples if s.lr_decay_samples is not None else s.train_samples
        wd_incr = s.train_samples
        warmup = s.lr_warmup_fraction * decay if s.lr_warmup_fraction is not None else s.lr_warmup_samples
    else:
        raise ValueError("pass --train-iters or --train-samples")
    return int(warmup), int(decay), int(wd_incr)


def wsd_decay_steps(schedule: ScheduleSettings) -> Optional[int]:
    """Length of WSD's annealing phase in samples (Megatron: --lr-wsd-decay-iters x --global-batch-size, or
    --lr-wsd-decay-samples); None when not given."""
    if schedule.train_iters:
        iters = schedule.lr_wsd_decay_iters
        return None if iters is None else iters * schedule.global_batch_size
    return schedule.lr_wsd_decay_samples


def build_param_scheduler(optimizer: Any, schedule: ScheduleSettings) -> OptimizerParamScheduler:
    """The learning-rate / weight-decay scheduler of `optimizer` from the run's `ScheduleSettings`."""
    warmup, decay, wd_incr = scheduler_steps(schedule)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=schedule.lr_warmup_init,
        max_lr=schedule.lr if schedule.lr is not None else 0.0,  # no --lr: only with --skip-train (never stepped)
        min_lr=schedule.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=schedule.lr_decay_style,
        start_wd=schedule.start_weight_decay,
        end_wd=schedule.end_weight_decay,
        wd_incr_steps=wd_incr,
        wd_incr_style=schedule.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=schedule.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=schedule.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps(schedule),
        lr_wsd_decay_style=schedule.lr_wsd_decay_style,
    )


def record_run_length(args: argparse.Namespace) -> None:
    """The flag layer's step of the schedule's set-up, where Megatron's builder takes it: the run's length and
    decay span written onto ``args`` (saved with every checkpoint): --lr-decay-iters defaults to --train-iters;
    with --train-samples, --train-iters is computed (`update_train_iters`) and --lr-decay-samples defaults to
    --train-samples."""
    if args.train_iters:
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
    elif args.train_samples:
        update_train_iters(args)
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples


def get_optimizer_param_scheduler(optimizer: Any, args: argparse.Namespace) -> OptimizerParamScheduler:
    """Megatron's signature: `build_param_scheduler` from the flags' record; `record_run_length` on ``args``."""
    schedule = ScheduleSettings.from_args(args)  # before --train-samples becomes --train-iters (Megatron's order)
    record_run_length(args)
    return build_param_scheduler(optimizer, schedule)


def update_train_iters(args: argparse.Namespace) -> None:
    """--train-samples → args.train_iters (accounting for batch-size ramp-up), as Megatron: a flag-layer step that
    writes the run's length onto ``args`` at start-up (RunConfigs.with_run_length reads it back)."""
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
