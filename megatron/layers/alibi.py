"""ALiBi (Press et al.; BLOOM, Megatron-DeepSpeed's ``--position-embedding-type alibi``): no position table, a
per-head linear bias ``slope_h * j`` added to the attention scores for key position j.

Slopes are BLOOM's: for n heads a power of two, ``start = 2 ** (-2 ** -(log2(n) - 3))`` and ``slope_i = start **
(i + 1)``; otherwise the slopes of the closest lower power of two p followed by every other slope of 2p, cut to n.
The bias depends on the key position only (``slope * j`` and ``slope * (j - i)`` differ by a per-row constant, which
the softmax ignores), so KV-cache decoding needs nothing beyond the cache's key positions 0..sk-1.
Each tensor-parallel rank keeps the slopes of its own heads (heads are split contiguously, as Megatron-DeepSpeed's
``alibi.reshape(tp, -1, ...)[tp_rank]``).
"""
from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> list[float]:
    """BLOOM's ALiBi slope of each of `num_heads` heads (any head count, not only powers of two)."""
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one attention head, got {num_heads}")

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_2(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


class AlibiBias:
    """The additive ALiBi bias of one tensor-parallel rank's heads: [heads on this rank, 1, sk] = slope * key index
    (fp32 slopes, cast to the scores' dtype), cached for the last (sk, device, dtype)."""

    def __init__(self, num_heads: int, tp_rank: int, tp_size: int) -> None:
        if num_heads % tp_size:
            raise ValueError(f"--num-attention-heads ({num_heads}) must be divisible by the tensor-parallel size "
                             f"({tp_size}) for ALiBi")
        per_rank = num_heads // tp_size
        self.slopes = torch.tensor(alibi_slopes(num_heads)[tp_rank * per_rank:(tp_rank + 1) * per_rank],
                                   dtype=torch.float32)
        self._cache: tuple = (None, None)

    def __call__(self, sk: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (sk, device, dtype)
        if self._cache[0] != key:
            positions = torch.arange(sk, dtype=torch.float32, device=device)
            bias = self.slopes.to(device)[:, None, None] * positions[None, None, :]
            self._cache = (key, bias.to(dtype))
        return self._cache[1]
