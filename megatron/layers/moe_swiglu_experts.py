"""The SwiGLU experts of a MoE layer as one autograd function over all runs of padded expert groups.

`GroupedExperts.compute` per run of experts (first, num, size): h = rows @ W1 (batched), silu(gate) * up, times the
routing weights, @ W2. Through autograd, with more than one run, the runs' slices of the stacked weights, inputs and
weights are `split` views, so the backward concatenates each run's gradients into fresh tensors (for W1 [E, h, 2F]
alone 25 MB a layer at 8 x 384 x 2048) on top of computing them. Here every run's gradient is written by its batched
GEMM (`out=`) straight into its slice of one gradient buffer per input, and the forward writes each run's output into
its rows of one output: the same kernels on the same operands as autograd's formulas for bmm, the SwiGLU
(`megatron.layers.mlp._SwiGLU`) and the weighting product, so outputs and gradients are bitwise equal.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron.layers.mlp import swiglu_grad


class _SwiGLUExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, grouped: torch.Tensor, weights: torch.Tensor, weight1: torch.Tensor,
                weight2: torch.Tensor, buckets: list) -> torch.Tensor:
        h = grouped.shape[-1]
        out = grouped.new_empty(grouped.shape) if len(buckets) > 1 else None
        saved, start = [], 0
        for first, num, size in buckets:
            rows = grouped[start:start + num * size].view(num, size, h)
            w1, w2 = weight1[first:first + num], weight2[first:first + num]
            pre = torch.bmm(rows, w1)
            gate, up = torch.chunk(pre, 2, dim=-1)
            activated = F.silu(gate)
            swiglu = activated * up
            inner = swiglu * weights[start:start + num * size].view(num, size, 1)
            if out is None:
                out = torch.bmm(inner, w2).view(num * size, h)
            else:
                torch.bmm(inner, w2, out=out[start:start + num * size].view(num, size, h))
            saved += [pre, activated, swiglu, inner]
            start += num * size
        ctx.buckets = buckets
        ctx.save_for_backward(grouped, weights, weight1, weight2, *saved)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):
        grouped, weights, weight1, weight2, *saved = ctx.saved_tensors
        need_rows, need_weights, need_w1, need_w2 = ctx.needs_input_grad[:4]
        h = grouped.shape[-1]
        grad_out = grad_out.contiguous()
        grad_rows = torch.empty_like(grouped) if need_rows else None
        grad_weights = torch.empty_like(weights) if need_weights else None
        grad_w1 = torch.empty_like(weight1) if need_w1 else None
        grad_w2 = torch.empty_like(weight2) if need_w2 else None
        start = 0
        for i, (first, num, size) in enumerate(ctx.buckets):
            pre, activated, swiglu, inner = saved[4 * i:4 * i + 4]
            n = num * size
            g = grad_out[start:start + n].view(num, size, h)
            w1, w2 = weight1[first:first + num], weight2[first:first + num]
            if need_w2:
                torch.bmm(inner.transpose(1, 2), g, out=grad_w2[first:first + num])
            grad_inner = g.bmm(w2.transpose(1, 2))
            wv = weights[start:start + n].view(num, size, 1)
            if need_weights:
                torch.sum(grad_inner * swiglu, dim=[2], keepdim=True, out=grad_weights[start:start + n].view(num, size, 1))
            grad_swiglu = grad_inner * wv
            grad_pre = swiglu_grad(grad_swiglu, pre, activated)
            if need_w1:
                rows = grouped[start:start + n].view(num, size, h)
                torch.bmm(rows.transpose(1, 2), grad_pre, out=grad_w1[first:first + num])
            if need_rows:
                torch.bmm(grad_pre, w1.transpose(1, 2), out=grad_rows[start:start + n].view(num, size, h))
            start += n
        return grad_rows, grad_weights, grad_w1, grad_w2, None


def applies(grouped: torch.Tensor, weights: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor) -> bool:
    """Whether `swiglu_experts` computes these (grad mode, one dtype throughout); else the autograd path runs."""
    return (torch.is_grad_enabled() and grouped.dtype == weights.dtype == weight1.dtype == weight2.dtype
            and grouped.is_contiguous() and weights.is_contiguous()
            and weight1.is_contiguous() and weight2.is_contiguous())


def swiglu_experts(grouped: torch.Tensor, weights: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor,
                   buckets: list) -> torch.Tensor:
    """Expert outputs [rows, h] of padded groups `grouped` [rows, h] laid out run by run (`buckets` of (first expert,
    experts, rows each)): (silu(x W1_gate) * (x W1_up) * weight) W2 per row, W1 [E, h, 2F], W2 [E, F, h]."""
    return _SwiGLUExperts.apply(grouped, weights, weight1, weight2, buckets)
