"""Rotary position embedding (RoPE) in the half-split convention of GPT-NeoX / Hugging Face Llama / Megatron-LM.

``inv_freq = 1 / base^(arange(0, d, 2) / d)`` over the rotary dimension d = int(kv_channels * rotary_percent),
``emb = cat(freqs, freqs)``; a head vector t becomes ``t[:d] * cos + rotate_half(t[:d]) * sin`` with
``rotate_half(x) = cat(-x[d/2:], x[:d/2])``; channels past d pass through. Positions are 0..s-1 plus the KV-cache
decode offset (as Megatron-LM, which does not read position_ids for RoPE).
"""
from __future__ import annotations

import torch


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


def apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on t [s, b, heads, head_dim] with cos/sin [s, 1, 1, d], d <= head_dim."""
    d = cos.size(-1)
    if d == t.size(-1):
        return t * cos + rotate_half(t) * sin
    t_rot, t_pass = t[..., :d], t[..., d:]
    return torch.cat((t_rot * cos + rotate_half(t_rot) * sin, t_pass), dim=-1)
