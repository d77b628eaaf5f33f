"""Global gradient-norm clipping and zero counting across model-parallel ranks (fp32 grads).

Each gradient is counted once over the whole model: tensor-parallel shards on every TP rank, duplicated
(non-TP) params only on TP rank 0, and params marked `shared` (e.g. the tied output embedding on the last
pipeline stage) not at all. Partial sums are all-reduced over the model-parallel (TP x PP) group; with the
distributed optimizer (each data-parallel rank holds a shard of the grads) first over the data-parallel group.
Under expert parallelism the expert params (``allreduce is False``) differ between expert-parallel ranks: their
partial sum is first reduced over the expert-data-parallel group (distributed optimizer) and the expert-parallel
group, then joins the dense one, so each expert counts once (Megatron-LM core's rule). With an expert-tensor-parallel
group other than TP (--expert-tensor-parallel-size) the expert partial sum is also reduced over that group, so it
holds the whole stage's, and joins the dense sum on TP rank 0 only; expert params then count on every rank.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

Tensors = Union[torch.Tensor, Iterable[torch.Tensor]]


def param_is_not_shared(param: torch.Tensor) -> bool:
    return not getattr(param, "shared", False)


def param_is_not_tp_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True for TP-sharded params, or on TP rank 0 for params every TP rank holds a copy of."""
    return bool(param_is_not_tensor_parallel_duplicate(param, tp_rank))


def is_expert_param(param: torch.Tensor) -> bool:
    """Megatron's mark of an expert parameter (megatron/layers/moe.py sets ``allreduce = False``)."""
    return getattr(param, "allreduce", True) is False


def grads_for_norm(params: Iterable[torch.Tensor], tp_rank: int = 0,
                   expert: Optional[bool] = None) -> List[torch.Tensor]:
    """The grads that count toward the global norm on this rank (only expert / only dense ones when `expert` is set)."""
    return [
        p.grad
        for p in params
        if p.grad is not None and param_is_not_shared(p)
        and ((expert and is_expert_param(p)) or (not expert and param_is_not_tp_duplicate(p, tp_rank)
                                                 and (expert is None or not is_expert_param(p))))
    ]


def _active(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _reduce(total: torch.Tensor, op, model_parallel_group, data_parallel_group) -> None:
    for group in (data_parallel_group, model_parallel_group):
        if _active(group):
            dist.all_reduce(total, op=op, group=group)


def _whole_stage(experts: torch.Tensor, op, expert_tensor_parallel_group, tp_rank: int) -> torch.Tensor:
    """With an expert-tensor-parallel group other than TP: the experts' partial sum of the whole pipeline stage,
    kept on TP rank 0 only (the model-parallel reduction then adds it once per stage)."""
    if expert_tensor_parallel_group is None:
        return experts
    if _active(expert_tensor_parallel_group):
        dist.all_reduce(experts, op=op, group=expert_tensor_parallel_group)
    return experts if tp_rank == 0 else torch.zeros_like(experts)


def _local_total(grads: List[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """max |g| (inf norm) or sum |g|^p of this rank's grads, as a [1] fp32 tensor."""
    if norm_type == math.inf:
        local = max((g.abs().max().float() for g in grads), default=torch.zeros((), device=device))
        return local.reshape(1).clone().to(torch.float32)
    if grads:
        per_tensor = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
        return (torch.linalg.vector_norm(per_tensor, norm_type) ** norm_type).reshape(1)
    return torch.zeros(1, dtype=torch.float32, device=device)


def get_grad_norm_fp32(
    grads: Tensors, model_parallel_group=None, norm_type: float = 2.0, device: Optional[torch.device] = None,
    data_parallel_group=None, expert_grads: Optional[List[torch.Tensor]] = None, expert_parallel_group=None,
    expert_data_parallel_group=None, expert_tensor_parallel_group=None, tp_rank: int = 0,
) -> float:
    """Norm of `grads` (already filtered) over all model-parallel ranks (and data-parallel ranks when the grads are
    sharded over them). `device` holds the reduction buffer when this rank has no grads to count (it must suit the
    backend: CUDA for NCCL). `expert_grads` (expert parallelism): the expert params' grads, reduced over
    `expert_data_parallel_group` (when sharded) and `expert_parallel_group` before joining the others."""
    if isinstance(grads, torch.Tensor):
        grads = [grads]
    grads = [g.detach() for g in grads]
    norm_type = float(norm_type)
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    total = _local_total(grads, norm_type, device)
    if expert_grads is not None:
        for group in (data_parallel_group,):
            if _active(group):
                dist.all_reduce(total, op=op, group=group)
        experts = _local_total([g.detach() for g in expert_grads], norm_type, device)
        _reduce(experts, op, expert_parallel_group, expert_data_parallel_group)
        experts = _whole_stage(experts, op, expert_tensor_parallel_group, tp_rank)
        total = torch.maximum(total, experts) if norm_type == math.inf else total + experts
        data_parallel_group = None
    _reduce(total, op, model_parallel_group, data_parallel_group)
    if norm_type == math.inf:
        return float(total.item())
    return float(total.item()) ** (1.0 / norm_type)


def clip_grad_norm_fp32(
    parameters: Tensors,
    grads_for_norm: Optional[Tensors],
    max_norm: float,
    model_parallel_group=None,
    norm_type: float = 2.0,
    data_parallel_group=None,
    device: Optional[torch.device] = None,
    expert_grads: Optional[List[torch.Tensor]] = None,
    expert_parallel_group=None,
    expert_data_parallel_group=None,
    expert_tensor_parallel_group=None,
    tp_rank: int = 0,
) -> float:
    """Scale the grads of `parameters` in place so their global norm is <= max_norm; return the norm before clipping.

    `grads_for_norm` are the grads that count toward the norm (see `grads_for_norm()`); None means every grad of
    `parameters` (single process / no model parallelism).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    for g in grads:
        if g.dtype != torch.float32:
            raise TypeError(f"clip_grad_norm_fp32 expects fp32 grads, got {g.dtype}; clip the fp32 main grads")
    if grads_for_norm is None:
        grads_for_norm = grads
    if device is None:
        device = parameters[0].device if parameters else None
    total_norm = get_grad_norm_fp32(grads_for_norm, model_parallel_group, norm_type, device, data_parallel_group,
                                    expert_grads, expert_parallel_group, expert_data_parallel_group,
                                    expert_tensor_parallel_group, tp_rank)
    clip_coeff = float(max_norm) / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)
    return total_norm


def count_zeros_fp32(parameters: Tensors, model_parallel_group=None, tp_rank: int = 0,
                     data_parallel_group=None, device: Optional[torch.device] = None,
                     expert_parallel_group=None, expert_data_parallel_group=None,
                     expert_tensor_parallel_group=None) -> int:
    """Number of exactly-zero gradient entries over the whole model (each param counted once); grads sharded over
    `data_parallel_group` (distributed optimizer) are summed over it too. With `expert_parallel_group` (expert
    parallelism) the expert params' zeros are summed over it (and over `expert_data_parallel_group` when sharded)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    if device is None:
        device = parameters[0].device if parameters else torch.device("cpu")

    def zeros(grads: List[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for g in grads:
            total += g.numel() - torch.count_nonzero(g)
        return total

    if expert_parallel_group is None:
        total = zeros(grads_for_norm(parameters, tp_rank))
        _reduce(total, dist.ReduceOp.SUM, model_parallel_group, data_parallel_group)
        return int(total.item())
    total = zeros(grads_for_norm(parameters, tp_rank, expert=False))
    if _active(data_parallel_group):
        dist.all_reduce(total, group=data_parallel_group)
    experts = zeros(grads_for_norm(parameters, tp_rank, expert=True))
    _reduce(experts, dist.ReduceOp.SUM, expert_parallel_group, expert_data_parallel_group)
    total += _whole_stage(experts, dist.ReduceOp.SUM, expert_tensor_parallel_group, tp_rank)
    _reduce(total, dist.ReduceOp.SUM, model_parallel_group, None)
    return int(total.item())
