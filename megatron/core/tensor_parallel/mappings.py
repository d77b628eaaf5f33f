"""Autograd-aware communication between tensor-parallel ranks (Megatron's "mappings").

Each function takes the process group explicitly; a group of None, or of size 1, means "no communication"
(the function is then an identity). Hidden-state tensors are [s, b, h]: tensor parallelism splits the last dim,
sequence parallelism splits dim 0.

| function                                      | forward                  | backward                 |
|-----------------------------------------------|--------------------------|--------------------------|
| copy_to_tensor_model_parallel_region          | identity                 | all-reduce               |
| reduce_from_tensor_model_parallel_region      | all-reduce               | identity                 |
| scatter_to_tensor_model_parallel_region       | keep my last-dim chunk   | all-gather last dim      |
| gather_from_tensor_model_parallel_region      | all-gather last dim      | keep my last-dim chunk   |
| scatter_to_sequence_parallel_region           | keep my dim-0 chunk      | all-gather dim 0         |
| gather_from_sequence_parallel_region          | all-gather dim 0         | reduce-scatter dim 0 (*) |
| reduce_scatter_to_sequence_parallel_region    | reduce-scatter dim 0     | all-gather dim 0         |

(*) or "keep my dim-0 chunk" with `tensor_parallel_output_grad=False`. Gloo has no native reduce-scatter on every
torch version, so for CPU tensors it is an all-reduce followed by taking this rank's chunk; NCCL (CUDA tensors) uses
the real collective.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

Group = Any


def group_size(group: Group) -> int:
    """World size of `group`; 1 when the group is None or torch.distributed is not initialised."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def group_rank(group: Group) -> int:
    """My rank inside `group`; 0 when the group is None or torch.distributed is not initialised."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


def _use_gloo_path(x: torch.Tensor, group: Group) -> bool:
    """CPU tensors (gloo) take the list all-gather / all-reduce+chunk path that every torch version supports."""
    return x.device.type == "cpu" or "nccl" not in str(dist.get_backend(group))


# ---- raw collectives (no autograd) -----------------------------------------------------------------------------
def all_reduce(x: torch.Tensor, group: Group, op: Optional[Any] = None) -> torch.Tensor:
    """Sum (or `op`) of `x` over the group, returned as a new contiguous tensor (the input is not modified)."""
    if group_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    return out


def split_along_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's chunk of `x` along `dim` (the size must divide evenly)."""
    world = group_size(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    if x.size(dim) % world != 0:
        raise ValueError(
            f"cannot split dimension {dim} of size {x.size(dim)} across {world} tensor-parallel ranks "
            f"(it must be divisible; check sequence length / hidden size vs --tensor-model-parallel-size)"
        )
    return torch.chunk(x, world, dim=dim)[group_rank(group)].contiguous()


def all_gather_along_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in group-rank order."""
    world = group_size(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    if dim == 0 and not _use_gloo_path(x, group):
        out = torch.empty((x.size(0) * world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather_single(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim).contiguous()


def reduce_scatter_along_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, then keep this rank's dim-0 chunk."""
    world = group_size(group)
    if world == 1:
        return x
    if x.size(0) % world != 0:
        raise ValueError(
            f"sequence-parallel reduce-scatter: first dimension {x.size(0)} is not divisible by the "
            f"tensor-parallel size {world} (make --seq-length divisible by --tensor-model-parallel-size)"
        )
    x = x.contiguous()
    if _use_gloo_path(x, group):
        return split_along_dim(all_reduce(x, group), group, 0)
    out = torch.empty((x.size(0) // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    rs_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rs_single(out, x, group=group)
    return out


# ---- autograd functions ----------------------------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return split_along_dim(x, group, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return all_gather_along_dim(grad, ctx.group, -1), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_gather_along_dim(x, group, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return split_along_dim(grad, ctx.group, -1), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return split_along_dim(x, group, 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return all_gather_along_dim(grad, ctx.group, 0), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, tensor_parallel_output_grad: bool) -> torch.Tensor:
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return all_gather_along_dim(x, group, 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_along_first_dim(grad, ctx.group), None, None
        return split_along_dim(grad, ctx.group, 0), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_along_first_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return all_gather_along_dim(grad, ctx.group, 0), None


# ---- public API -------------------------------------------------------------------------------------------------
def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel layer)."""
    if group_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward, identity backward (output of a row-parallel layer)."""
    if group_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep my chunk of the last dim forward; all-gather the gradient backward."""
    if group_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim forward; keep my chunk of the gradient backward."""
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep my chunk of dim 0 (sequence) forward; all-gather along dim 0 backward."""
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Group, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather along dim 0 forward; backward reduce-scatters the gradient (or, when the consumer's gradient is
    already identical on every TP rank, `tensor_parallel_output_grad=False`, just keeps my chunk)."""
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Reduce-scatter along dim 0 forward (output of a row-parallel layer under SP); all-gather backward."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group)
