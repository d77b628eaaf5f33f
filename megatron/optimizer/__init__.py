"""Megatron optimizers: param groups, AdamW/SGD, fp16/bf16 mixed precision, loss scaling, grad clipping.

Entry point: `get_megatron_optimizer(model_chunks, config, parallel_state)`.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from megatron.core import parallel_state as ps
from megatron.optimizer.clip_grads import clip_grad_norm_fp32, count_zeros_fp32
from megatron.optimizer.distrib_optimizer import DistributedOptimizer, shard_param_groups
from megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron.optimizer.muon import MuonWithAdamW, muon_param_groups
from megatron.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
)
from megatron.optimizer.optimizer_config import OptimizerConfig, optimizer_config_from_args
from megatron.optimizer.param_groups import ParamCond, get_param_groups

__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "MuonWithAdamW",
    "OptimizerConfig",
    "clip_grad_norm_fp32",
    "count_zeros_fp32",
    "get_megatron_optimizer",
    "get_param_groups",
    "optimizer_config_from_args",
]

def _resolve_parallel_state(parallel_state):
    if parallel_state is not None:
        return parallel_state.mp_group, parallel_state.tp_rank
    if ps.model_parallel_is_initialized():
        state = ps.get_parallel_state()
        return state.mp_group, state.tp_rank
    return None, 0



def _expert_state(parallel_state):
    """The parallel state that holds the expert-parallel groups (the given one, else the current one)."""
    if parallel_state is not None:
        return parallel_state if hasattr(parallel_state, "ep_size") else None
    return ps.get_parallel_state() if ps.model_parallel_is_initialized() else None


def _can_use_fused_adam(param_groups: list[dict], config: OptimizerConfig) -> Optional[bool]:
    """torch's fused AdamW (one kernel over all tensors; ~6x faster than the for-each path on CPU) when every
    parameter the inner optimizer updates is a floating tensor on one CPU/CUDA device type; None (torch picks)
    otherwise. The mixed-precision optimizers step fp32 main copies, which always qualify."""
    if config.fp16 or config.bf16:
        return True
    devices = {p.device.type for g in param_groups for p in g["params"]}
    dtypes_ok = all(p.is_floating_point() for g in param_groups for p in g["params"])
    return True if len(devices) == 1 and devices <= {"cpu", "cuda"} and dtypes_ok else None


def _muon(model_chunks, param_groups: list[dict], config: OptimizerConfig, parallel_state) -> MuonWithAdamW:
    """Muon for the 2-D weights, AdamW for the rest (megatron/optimizer/muon.py), over this run's TP groups;
    `--optimizer dist_muon`: distributed layer-wise over the data-parallel ranks (megatron/optimizer/layer_wise.py)."""
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    groups = muon_param_groups(chunks, param_groups, config.muon_split_qkv)
    state = parallel_state if parallel_state is not None else (
        ps.get_parallel_state() if ps.model_parallel_is_initialized() else None)
    tp_group = getattr(state, "tp_group", None) if getattr(state, "tp_size", 1) > 1 else None
    etp_size = getattr(state, "etp_size", None) or getattr(state, "tp_size", 1)
    etp_group = (getattr(state, "etp_group", None) or getattr(state, "tp_group", None)) if etp_size > 1 else None
    adam = [g for g in groups if not g["muon"]]
    layer_wise = config.optimizer == "dist_muon" and state is not None  # Megatron-LM's layer-wise distribution
    dp_group = state.dp_cp_group if layer_wise else None
    edp_group = state.edp_group if layer_wise and getattr(state, "ep_size", 1) > 1 else None
    return MuonWithAdamW(
        groups, lr=config.lr, weight_decay=config.weight_decay, momentum=config.muon_momentum,
        nesterov=config.muon_use_nesterov, scale_mode=config.muon_scale_mode,
        extra_scale_factor=config.muon_extra_scale_factor, num_ns_steps=config.muon_num_ns_steps,
        fp32_matmul_prec=config.muon_fp32_matmul_prec, tp_mode=config.muon_tp_mode,
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, tp_group=tp_group,
        expert_tp_group=etp_group, adam_fused=_can_use_fused_adam(adam, config) if adam else None,
        dp_group=dp_group, expert_dp_group=edp_group)


def get_megatron_optimizer(
    model_chunks: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    config: OptimizerConfig,
    parallel_state=None,
    no_weight_decay_cond: Optional[ParamCond] = None,
    scale_lr_cond: Optional[ParamCond] = None,
    lr_mult: float = 1.0,
) -> MegatronOptimizer:
    """Build the optimizer for `model_chunks` (modules, optionally DDP-wrapped). `parallel_state` supplies the
    model-parallel group (grad norm, inf check), tp_rank and, for `--use-distributed-optimizer` (local DDP chunks
    built with use_distributed_optimizer=True), the data-parallel group; None means the current state, or a single
    process."""
    param_groups = get_param_groups(model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult)
    if not param_groups:
        raise ValueError("get_megatron_optimizer: the model has no trainable parameters")
    # The scheduler re-sets these every step; set them here too so an optimizer used without one is right.
    for group in param_groups:
        group["lr"] = config.lr * group["lr_mult"]
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
    shard_entries = None
    if config.use_distributed_optimizer:
        chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
        param_groups, shard_entries = shard_param_groups(chunks, param_groups)
    if config.optimizer == "adam":
        # Megatron's Adam is Adam with decoupled weight decay (apex FusedAdam adam_w_mode) = torch AdamW.
        inner = torch.optim.AdamW(
            param_groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            fused=_can_use_fused_adam(param_groups, config),
        )
    elif config.optimizer in ("muon", "dist_muon"):
        inner = _muon(model_chunks, param_groups, config, parallel_state)
    elif config.optimizer == "sgd":
        inner = torch.optim.SGD(param_groups, lr=config.lr, weight_decay=config.weight_decay,
                                momentum=config.sgd_momentum)
    else:
        raise ValueError(f"--optimizer {config.optimizer!r} is not supported; use 'adam', 'sgd', 'muon' or 'dist_muon'")

    mp_group, tp_rank = _resolve_parallel_state(parallel_state)
    grad_scaler: Optional[MegatronGradScaler] = None
    if config.fp16 or config.bf16:
        device = next((p.device for g in param_groups for p in g["params"]), torch.device("cpu"))
        if config.loss_scale:
            grad_scaler = ConstantGradScaler(config.loss_scale, device=device)
        elif config.fp16:
            grad_scaler = DynamicGradScaler(
                initial_scale=config.initial_loss_scale,
                min_scale=config.min_loss_scale,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=config.loss_scale_window,
                hysteresis=config.hysteresis,
                device=device,
            )
    if shard_entries is not None:
        dp_group = getattr(parallel_state, "dp_cp_group", None) if parallel_state is not None else chunks[0].dp_group
        optimizer: MegatronOptimizer = DistributedOptimizer(
            inner, shard_entries, chunks, config.clip_grad, config.log_num_zeros_in_grad, config.fp16, config.bf16,
            config.params_dtype, grad_scaler, mp_group, tp_rank, data_parallel_group=dp_group,
        )
    elif config.fp16 or config.bf16:
        optimizer = Float16OptimizerWithFloat16Params(
            inner, config.clip_grad, config.log_num_zeros_in_grad, config.fp16, config.bf16, config.params_dtype,
            grad_scaler, mp_group, tp_rank,
        )
    else:
        optimizer = FP32Optimizer(inner, config.clip_grad, config.log_num_zeros_in_grad, mp_group, tp_rank)
    state = _expert_state(parallel_state)
    if state is not None and getattr(state, "expert_groups", state.ep_size > 1):  # expert grads differ between
        # expert-parallel (and expert-tensor-parallel) ranks
        optimizer.expert_parallel_group, optimizer.expert_data_parallel_group = state.ep_group, state.edp_group
        if getattr(state, "expert_tp_differs", False):  # --expert-tensor-parallel-size: experts split over their own group
            optimizer.expert_tensor_parallel_group = state.etp_group
    return optimizer
