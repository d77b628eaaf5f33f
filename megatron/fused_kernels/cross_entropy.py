"""Triton vocab-parallel cross entropy that never materialises the softmax.

Forward, one pass over this rank's logits [rows, V/tp] per row: the local max m, the local sum of exp(x - m) and the
target's logit when this rank owns it (an online max/sum over vocabulary blocks). The tensor-parallel all-reduces of
megatron/core/tensor_parallel/cross_entropy.py then combine them: M = max over ranks, S = sum of s * exp(m - M),
the target logit by SUM; loss = log(S) + M - target. Backward, one more pass: (exp(x - M - log S) - onehot) * dloss,
recomputed from the saved logits, written into a new gradient (the logits are not modified). Label smoothing is not
fused (the caller keeps the unfused path for it).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

_BLOCK = 4096


@triton.jit
def _ce_fwd(x_ptr, t_ptr, max_ptr, sum_ptr, tgt_ptr, v, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(t_ptr + row) - vocab_start
    m = float("-inf")
    s = 0.0
    picked = 0.0
    for start in range(0, v, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < v
        x = tl.load(x_ptr + row * v + cols, mask=inside, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
        picked += tl.sum(tl.where(cols == target, x, 0.0), axis=0)
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    tl.store(tgt_ptr + row, picked)


@triton.jit
def _ce_bwd(x_ptr, t_ptr, lse_ptr, g_ptr, dx_ptr, v, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < v
    target = tl.load(t_ptr + row) - vocab_start
    x = tl.load(x_ptr + row * v + cols, mask=inside, other=0.0).to(tl.float32)
    p = tl.exp(x - tl.load(lse_ptr + row))
    d = (p - tl.where(cols == target, 1.0, 0.0)) * tl.load(g_ptr + row).to(tl.float32)
    tl.store(dx_ptr + row * v + cols, d.to(dx_ptr.dtype.element_ty), mask=inside)


def _all_reduce(t: torch.Tensor, group: Any, op: Any) -> None:
    if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
        v = logits.size(-1)
        x = logits.contiguous().view(-1, v)
        t = target.contiguous().view(-1)
        rows = x.size(0)
        local_max = torch.empty(rows, dtype=torch.float32, device=x.device)
        local_sum = torch.empty_like(local_max)
        picked = torch.empty_like(local_max)
        _ce_fwd[(rows,)](x, t, local_max, local_sum, picked, v, vocab_start, BLOCK=min(_BLOCK, triton.next_power_of_2(v)))
        global_max = local_max.clone()
        _all_reduce(global_max, group, dist.ReduceOp.MAX)
        sum_exp = local_sum * torch.exp(local_max - global_max)
        _all_reduce(sum_exp, group, dist.ReduceOp.SUM)
        _all_reduce(picked, group, dist.ReduceOp.SUM)
        lse = torch.log(sum_exp) + global_max
        ctx.save_for_backward(x, t, lse)
        ctx.vocab_start = vocab_start
        ctx.shape = logits.shape
        return (lse - picked).view_as(target).to(logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor):
        x, t, lse = ctx.saved_tensors
        rows, v = x.shape
        dx = torch.empty_like(x)
        block = min(_BLOCK, triton.next_power_of_2(v))
        _ce_bwd[(rows, triton.cdiv(v, block))](x, t, lse, grad_loss.contiguous().view(-1), dx, v, ctx.vocab_start,
                                               BLOCK=block)
        return dx.view(ctx.shape), None, None, None


def fused_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                       group: Any = None) -> torch.Tensor:
    """Per-token loss [*target.shape] from this rank's logits [*target.shape, V/tp] whose first column is vocabulary
    id `vocab_start`; `group` is the tensor-parallel group (None: one rank)."""
    return _FusedVocabParallelCrossEntropy.apply(logits, target, int(vocab_start), group)
