"""Triton fused bias + tanh GeLU and bias + SwiGLU, forward and backward.

bias_gelu: ``gelu_tanh(x + bias)`` = 0.5 y (1 + tanh(0.79788456 (y + 0.044715 y^3))), Megatron's fused bias_gelu
(the tanh approximation; its backward is the closed form with the 0.1070322243 term). bias_swiglu: with
``y = x + bias`` split as [gate; up] on the last dim, ``silu(gate) * up``; the backward writes d gate and d up into
one [.., 2F] gradient. The bias is added in the input dtype (as the unfused ``x + bias``); both then compute in fp32 and store in the input dtype; the bias gradient is the fp32 sum of the
input gradient over rows. One program per block of elements (GeLU) or per row (SwiGLU).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

_BLOCK = 1024


@triton.jit
def _tanh(z):
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0


@triton.jit
def _bias_gelu_fwd(x_ptr, b_ptr, y_ptr, n, f, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    v = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v = (v + tl.load(b_ptr + offs % f, mask=inside, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        v = v.to(tl.float32)
    t = _tanh(0.79788456 * v * (1.0 + 0.044715 * v * v))
    tl.store(y_ptr + offs, (0.5 * v * (1.0 + t)).to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _bias_gelu_bwd(g_ptr, x_ptr, b_ptr, dx_ptr, n, f, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    v = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v = (v + tl.load(b_ptr + offs % f, mask=inside, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        v = v.to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    t = _tanh(0.79788456 * v * (1.0 + 0.044715 * v * v))
    ff = 0.5 * v * ((1.0 - t * t) * (0.79788456 + 0.1070322243 * v * v)) + 0.5 * (1.0 + t)
    tl.store(dx_ptr + offs, (ff * g).to(dx_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _swiglu_inputs(x_ptr, b_ptr, row, cols, inside, f, HAS_BIAS: tl.constexpr):
    """The gate and up halves of row `row` in fp32, plus the bias rounded to the input dtype first (as torch adds it)."""
    gate = tl.load(x_ptr + row * 2 * f + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * f + f + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        gate = (gate + tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        up = (up + tl.load(b_ptr + f + cols, mask=inside, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        gate, up = gate.to(tl.float32), up.to(tl.float32)
    return gate, up


@triton.jit
def _bias_swiglu_fwd(x_ptr, b_ptr, y_ptr, f, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < f
    gate, up = _swiglu_inputs(x_ptr, b_ptr, row, cols, inside, f, HAS_BIAS)
    y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + row * f + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _bias_swiglu_bwd(g_ptr, x_ptr, b_ptr, dx_ptr, f, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < f
    gate, up = _swiglu_inputs(x_ptr, b_ptr, row, cols, inside, f, HAS_BIAS)
    g = tl.load(g_ptr + row * f + cols, mask=inside, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = g * gate * sig
    tl.store(dx_ptr + row * 2 * f + cols, d_gate.to(dx_ptr.dtype.element_ty), mask=inside)
    tl.store(dx_ptr + row * 2 * f + f + cols, d_up.to(dx_ptr.dtype.element_ty), mask=inside)


def _bias_grad(dx: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if bias is None or not bias.requires_grad:
        return None
    return dx.reshape(-1, dx.size(-1)).float().sum(0).to(bias.dtype)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        n, f = x.numel(), x.size(-1)
        _bias_gelu_fwd[(triton.cdiv(n, _BLOCK),)](x, bias if bias is not None else x, y, n, f,
                                                  HAS_BIAS=bias is not None, BLOCK=_BLOCK)
        ctx.save_for_backward(x, bias)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor):
        x, bias = ctx.saved_tensors
        g = g.contiguous()
        dx = torch.empty_like(x)
        n, f = x.numel(), x.size(-1)
        _bias_gelu_bwd[(triton.cdiv(n, _BLOCK),)](g, x, bias if bias is not None else x, dx, n, f,
                                                  HAS_BIAS=bias is not None, BLOCK=_BLOCK)
        return dx, _bias_grad(dx, bias)


class _BiasSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x = x.contiguous()
        f = x.size(-1) // 2
        rows = x.numel() // (2 * f)
        y = x.new_empty(*x.shape[:-1], f)
        block = min(_BLOCK, triton.next_power_of_2(f))
        _bias_swiglu_fwd[(rows, triton.cdiv(f, block))](x, bias if bias is not None else x, y, f,
                                                        HAS_BIAS=bias is not None, BLOCK=block)
        ctx.save_for_backward(x, bias)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor):
        x, bias = ctx.saved_tensors
        g = g.contiguous()
        f = x.size(-1) // 2
        rows = x.numel() // (2 * f)
        dx = torch.empty_like(x)
        block = min(_BLOCK, triton.next_power_of_2(f))
        _bias_swiglu_bwd[(rows, triton.cdiv(f, block))](g, x, bias if bias is not None else x, dx, f,
                                                        HAS_BIAS=bias is not None, BLOCK=block)
        return dx, _bias_grad(dx, bias)


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gelu_tanh(x + bias) (bias [F] over x [.., F], or None)."""
    return _BiasGelu.apply(x, bias)


def bias_swiglu(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """silu(gate) * up of y = x + bias split [gate; up] on the last dim (x [.., 2F], bias [2F] or None)."""
    if x.size(-1) % 2:
        raise ValueError(f"bias_swiglu: the last dimension ({x.size(-1)}) must be even ([gate; up])")
    return _BiasSwiGLU.apply(x, bias)
