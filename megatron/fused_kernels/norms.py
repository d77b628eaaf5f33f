"""Triton RMSNorm and LayerNorm, forward and backward, with the numerics of megatron/layers/norms.py.

RMSNorm: ``weight * (x.float() * rsqrt(mean(x^2) + eps)).type_as(x)`` (Megatron-LM's legacy / HF Llama op order),
stored in the weight's dtype (the promoted dtype, cast to the weight's, as the module returns). LayerNorm: fp32
statistics (biased variance), ``(x - mean) * rstd * w + b`` stored in x's dtype; the module casts w and b to x's
dtype first and the result to the parameters' dtype after, as MixedFusedLayerNorm does.
One program per row of the forward; the backward runs a fixed number of programs, each looping over its rows and
accumulating its partial weight (and bias) gradient in fp32, summed by torch at the end.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

_BWD_PROGRAMS = 128


@triton.jit
def _rms_fwd(x_ptr, w_ptr, y_ptr, r_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * r).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(r_ptr + row, r)


@triton.jit
def _rms_bwd(g_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, dw_ptr, rows, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, rows, step):
        x = tl.load(x_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row)
        normed = x * r
        dw += g * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        gw = g * w
        dx = r * (gw - normed * (tl.sum(gw * normed, axis=0) / n))
        tl.store(dx_ptr + row * n + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)
    tl.store(dw_ptr + pid * n + cols, dw, mask=inside)


@triton.jit
def _ln_fwd(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n
    xc = tl.where(inside, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (xc * rstd * w + b).to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _ln_bwd(g_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, rows, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, rows, step):
        x = tl.load(x_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
        xhat = tl.where(inside, (x - tl.load(mean_ptr + row)) * tl.load(rstd_ptr + row), 0.0)
        dw += g * xhat
        db += g
        gw = g * w
        dx = (gw - tl.sum(gw, axis=0) / n - xhat * (tl.sum(gw * xhat, axis=0) / n)) * tl.load(rstd_ptr + row)
        tl.store(dx_ptr + row * n + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)
    tl.store(dw_ptr + pid * n + cols, dw, mask=inside)
    tl.store(db_ptr + pid * n + cols, db, mask=inside)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    x = x.contiguous()
    n = x.size(-1)
    return x, x.numel() // n, n


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x, rows, n = _rows(x)
        y = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
        r = torch.empty(rows, dtype=torch.float32, device=x.device)
        _rms_fwd[(rows,)](x, weight, y, r, n, float(eps), BLOCK=triton.next_power_of_2(n))
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        g, rows, n = _rows(g)
        dx = torch.empty_like(x)
        programs = max(1, min(rows, _BWD_PROGRAMS))
        dw = torch.empty(programs, n, dtype=torch.float32, device=x.device)
        _rms_bwd[(programs,)](g, x, weight, r, dx, dw, rows, n, BLOCK=triton.next_power_of_2(n))
        return dx, dw.sum(0).to(weight.dtype), None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        x, rows, n = _rows(x)
        y = torch.empty_like(x)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        _ln_fwd[(rows,)](x, weight, bias, y, mean, rstd, n, float(eps), BLOCK=triton.next_power_of_2(n))
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        g, rows, n = _rows(g)
        dx = torch.empty_like(x)
        programs = max(1, min(rows, _BWD_PROGRAMS))
        dw = torch.empty(programs, n, dtype=torch.float32, device=x.device)
        db = torch.empty_like(dw)
        _ln_bwd[(programs,)](g, x, weight, mean, rstd, dx, dw, db, rows, n, BLOCK=triton.next_power_of_2(n))
        return dx, dw.sum(0).to(weight.dtype), db.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x with `weight`, in the weight's dtype (see the module docstring)."""
    return _RMSNorm.apply(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of x; weight and bias in x's dtype; output in x's dtype."""
    if bias is None:
        bias = torch.zeros_like(weight)
    return _LayerNorm.apply(x, weight, bias, eps)
