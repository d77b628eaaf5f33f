"""Triton scaled masked softmax and scaled causal (upper-triangular) masked softmax, forward and backward.

The numbers of Megatron's pure-PyTorch path (`FusedScaleMaskSoftmax.forward_torch_softmax` with
`attention_mask_func`): ``softmax(masked_fill(scale * x, mask, -10000))`` computed in fp32 and stored in the input
dtype. A fully masked row is therefore uniform (Megatron's CUDA kernel writes zeros there; loss masking makes the two
equivalent, and ours keeps the torch path's numbers). Backward: ``dx = scale * y * (dy - sum(dy * y))``, zero where
masked (the fill cuts the gradient there, as in the torch path).
One program per row of the [b, np, sq, sk] scores; the mask is read through its (broadcast) strides, never expanded.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable


@triton.jit
def _softmax_fwd(x_ptr, y_ptr, mask_ptr, scale, np_, sq, sk, m_sb, m_sh, m_sq, causal_offset,
                 HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    q = row % sq
    h = (row // sq) % np_
    b = row // (sq * np_)
    cols = tl.arange(0, BLOCK)
    inside = cols < sk
    x = tl.load(x_ptr + row * sk + cols, mask=inside, other=0.0).to(tl.float32) * scale
    if HAS_MASK:
        masked = tl.load(mask_ptr + b * m_sb + h * m_sh + q * m_sq + cols, mask=inside, other=0)
        x = tl.where(masked != 0, -10000.0, x)
    if CAUSAL:
        x = tl.where(cols > q + causal_offset, -10000.0, x)
    x = tl.where(inside, x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * sk + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _softmax_bwd(dy_ptr, y_ptr, dx_ptr, mask_ptr, scale, np_, sq, sk, m_sb, m_sh, m_sq, causal_offset,
                 HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    q = row % sq
    h = (row // sq) % np_
    b = row // (sq * np_)
    cols = tl.arange(0, BLOCK)
    inside = cols < sk
    dy = tl.load(dy_ptr + row * sk + cols, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * sk + cols, mask=inside, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(dy * y, axis=0))
    if HAS_MASK:
        masked = tl.load(mask_ptr + b * m_sb + h * m_sh + q * m_sq + cols, mask=inside, other=0)
        dx = tl.where(masked != 0, 0.0, dx)
    if CAUSAL:
        dx = tl.where(cols > q + causal_offset, 0.0, dx)
    tl.store(dx_ptr + row * sk + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


class _ScaledMaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool) -> torch.Tensor:
        b, np_, sq, sk = x.shape
        x = x.contiguous()
        y = torch.empty_like(x)
        if mask is not None:
            m = mask.expand(b, np_, sq, sk)
            if m.stride(-1) != 1:
                m = m.contiguous()
            m = m.view(torch.uint8) if m.dtype == torch.bool else m
            strides = (m.stride(0), m.stride(1), m.stride(2))
        else:
            m, strides = x, (0, 0, 0)  # never read (HAS_MASK False)
        _softmax_fwd[(b * np_ * sq,)](x, y, m, float(scale), np_, sq, sk, *strides, sk - sq,
                                      HAS_MASK=mask is not None, CAUSAL=causal, BLOCK=_block(sk))
        ctx.save_for_backward(y, m)
        ctx.args = (float(scale), np_, sq, sk, *strides, sk - sq)
        ctx.flags = dict(HAS_MASK=mask is not None, CAUSAL=causal, BLOCK=_block(sk))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor):
        y, m = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        _softmax_bwd[(y.numel() // y.size(-1),)](dy, y, dx, m, *ctx.args, **ctx.flags)
        return dx, None, None, None


def scaled_masked_softmax(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """softmax(masked_fill(scale * x, mask, -10000)) over the last dim of x [b, np, sq, sk]; mask bool broadcastable
    to x (True = masked out) or None; fp32 inside, output in x's dtype."""
    return _ScaledMaskedSoftmax.apply(x, mask, scale, False)


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The causal case: key k is masked for query q when k > q + (sk - sq) (the mask tensor is not read)."""
    return _ScaledMaskedSoftmax.apply(x, None, scale, True)
