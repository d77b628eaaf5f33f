"""Triton RoPE apply (half-split convention of megatron/layers/rotary.py), forward and backward.

``t[..., :d] * cos + rotate_half(t[..., :d]) * sin`` with ``rotate_half(x) = cat(-x2, x1)``; channels past d pass
through. The backward is the same kernel with sin negated (rotate_half's transpose). fp32 inside, stored in t's
dtype; cos and sin are read as fp32. One program per (position, batch) row of t [s, b, h, head_dim]; t is read
through its strides, so the q/k views of a fused QKV output need no copy.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable


@triton.jit
def _rope(t_ptr, cos_ptr, sin_ptr, out_ptr, b, h, hd, half, ts_s, ts_b, ts_h, sign,
          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    s = row // b
    bi = row % b
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    inside = (heads < h) & (cols < hd)
    base = t_ptr + s * ts_s + bi * ts_b + heads * ts_h
    t = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
    d = 2 * half
    rot = cols < d
    partner = tl.where(cols < half, cols + half, cols - half)
    tp = tl.load(base + partner, mask=inside & rot, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + s * d + cols, mask=rot & (cols < hd), other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + s * d + cols, mask=rot & (cols < hd), other=0.0).to(tl.float32) * sign
    rotated = tl.where(cols < half, -tp, tp)
    out = tl.where(rot, t * cos + rotated * sin, t)
    tl.store(out_ptr + row * h * hd + heads * hd + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def _launch(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    s, b, h, hd = t.shape
    if t.stride(-1) != 1:
        t = t.contiguous()
    out = torch.empty((s, b, h, hd), dtype=t.dtype, device=t.device)
    _rope[(s * b,)](t, cos, sin, out, b, h, hd, cos.size(-1) // 2, t.stride(0), t.stride(1), t.stride(2), sign,
                    BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(hd))
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _launch(t, cos, sin, 1.0)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _launch(g, cos, sin, -1.0), None, None


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on t [s, b, h, head_dim] with cos/sin [s, 1, 1, d] (d even, d <= head_dim); no gradient to cos/sin."""
    d = cos.size(-1)
    if d % 2 or d > t.size(-1) or cos.size(0) != t.size(0):
        raise ValueError(f"apply_rope: rotary dim {d} must be even, <= head_dim {t.size(-1)}, one row per position")
    cos = cos.reshape(cos.size(0), d).float().contiguous()
    sin = sin.reshape(sin.size(0), d).float().contiguous()
    return _Rope.apply(t, cos, sin)
