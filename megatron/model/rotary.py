"""Rotary position embedding (RoPE) in the half-split convention of GPT-NeoX / Hugging Face Llama / Megatron-LM.

``inv_freq = 1 / base^(arange(0, d, 2) / d)`` over the rotary dimension d = int(kv_channels * rotary_percent),
``emb = cat(freqs, freqs)``; a head vector t becomes ``t[:d] * cos + rotate_half(t[:d]) * sin`` with
``rotate_half(x) = cat(-x[d/2:], x[:d/2])``; channels past d pass through. Positions are 0..s-1 plus the KV-cache
decode offset (as Megatron-LM, which does not read position_ids for RoPE).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from megatron import fused_kernels


class RotaryEmbedding:
    """cos/sin tables (fp32, grown on demand, one per device) for one rotary dimension and base. Holds no
    parameters or buffers, so state dicts and dtype conversions of the model are unaffected."""

    def __init__(self, rotary_dim: int, base: float = 10000.0) -> None:
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self._tables: dict = {}

    def _table(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._tables.get(device)
        if cached is None or cached[0].size(0) < length:
            size = max(length, 2 * cached[0].size(0) if cached is not None else length)
            d = self.rotary_dim
            inv_freq = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
            freqs = torch.outer(torch.arange(size, device=device, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cached = (emb.cos(), emb.sin())
            self._tables[device] = cached
        return cached

    def cos_sin(self, seq_len: int, offset: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions offset..offset+seq_len-1, shaped [s, 1, 1, d] in `dtype`."""
        cos, sin = self._table(offset + seq_len, device)
        cos = cos[offset:offset + seq_len, None, None, :].to(dtype)
        sin = sin[offset:offset + seq_len, None, None, :].to(dtype)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_into(out: torch.Tensor, t: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """out += rotate_half(t) * sin (sign 1) or its transpose, rotate_half^T(t) * sin (sign -1), half by half."""
    half = t.size(-1) // 2
    low, high = out[..., :half], out[..., half:]
    (low.sub_ if sign > 0 else low.add_)(t[..., half:] * sin[..., :half])  # not addcmul_: it may fuse (FMA)
    (high.add_ if sign > 0 else high.sub_)(t[..., :half] * sin[..., half:])
    return out


class _RotaryFull(torch.autograd.Function):
    """t * cos + rotate_half(t) * sin over the whole head dimension in three passes (no negated copy, no cat), and
    its backward g * cos + rotate_half^T(g * sin) likewise. Bitwise equal to the plain expression and its autograd:
    each element is the same product and sum (a negation moved onto the other factor is exact)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_into(t * cos, t, sin, 1.0)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_into(grad_output * cos, grad_output, sin, -1.0), None, None


def apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on t [s, b, heads, head_dim] with cos/sin [s, 1, 1, d], d <= head_dim."""
    d = cos.size(-1)
    if d % 2 == 0 and not (cos.requires_grad or sin.requires_grad) and fused_kernels.runs_on(t):
        return fused_kernels.apply_rope(t, cos, sin)  # the Triton kernel: same numbers, one pass
    if d == t.size(-1):
        if d % 2 == 0 and not cos.requires_grad and not sin.requires_grad:
            return _RotaryFull.apply(t, cos, sin)
        return t * cos + rotate_half(t) * sin
    t_rot, t_pass = t[..., :d], t[..., d:]
    return torch.cat((t_rot * cos + rotate_half(t_rot) * sin, t_pass), dim=-1)
