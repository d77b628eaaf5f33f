"""The paged KV cache as the attention layers see it (the inference engine's path, megatron/inference/).

`PagedKVCache` holds every layer's cache as one pool of fixed-size blocks: a tensor per layer of [num_blocks *
block_size, ...] token slots, allocated on first use (ParallelAttention: K and V [slots, query groups / TP, head dim];
multi-latent attention: the normed latent [slots, kv_lora_rank] and the rotated rope key [slots, rope dim]).

`PagedStep` describes one engine step and is passed to the model where the static generator passes InferenceParams:
the step's tokens of R requests are flattened into one sequence of T tokens (hidden [T, 1, h]), each with its own
position; `write_slots` [T] says where each token's K/V goes, `read_slots` [R, L] where each request's context
(cached tokens plus this step's) lies. A layer writes this step's K/V (`write`), gathers each request's context padded
to the longest (`gather`), pads the queries to [R, Q] (`pad_queries`) and attends under `attend_mask` [R, Q, L]
(causal from each request's own positions, optionally a sliding window), then flattens back (`unpad`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron.layers.fused_softmax import softmax_with_sink


class PagedKVCache:
    """Per-layer block pools of `num_blocks` blocks of `block_size` token slots each (lazily allocated)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers: dict[int, tuple[torch.Tensor, ...]] = {}

    def storage(self, layer_number: int, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The layer's pool tensors, [slots, *t.shape[1:]] for each tensor t of `like` (allocated on first use)."""
        if layer_number not in self.layers:
            slots = self.num_blocks * self.block_size
            # Uninitialised: a step reads only slots written before (padding re-reads a request's last position).
            self.layers[layer_number] = tuple(t.new_empty((slots,) + tuple(t.shape[1:])) for t in like)
        return self.layers[layer_number]


class PagedStep:
    """One engine step's layout over the paged cache (see the module docstring); built by the engine."""

    def __init__(self, cache: PagedKVCache, positions: torch.Tensor, write_slots: torch.Tensor,
                 query_counts: list[int], read_slots: torch.Tensor) -> None:
        device = positions.device
        self.cache = cache
        self.positions = positions  # [T]
        self.write_slots = write_slots  # [T]
        self.read_slots = read_slots  # [R, L]
        r, q_max = len(query_counts), max(query_counts)
        counts = torch.tensor(query_counts, dtype=torch.long, device=device)
        starts = torch.cumsum(counts, 0) - counts
        offsets = torch.arange(q_max, device=device)
        self.decode_only = q_max == 1  # one token per request: [T] is already [R, 1]
        self.query_valid = offsets[None, :] < counts[:, None]  # [R, Q]
        self.query_index = torch.where(self.query_valid, starts[:, None] + offsets[None, :], 0)  # [R, Q] into T
        self.query_positions = torch.where(self.query_valid, positions[self.query_index], 0)  # padding: position 0
        self.valid_index = torch.nonzero(self.query_valid.reshape(-1))[:, 0]  # [T] into R * Q
        self.max_context = int(read_slots.size(1))
        self.num_requests = r
        self._masks: dict[Any, torch.Tensor] = {}
        self._rotary: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend_mask(self, window: Optional[tuple] = None) -> torch.Tensor:
        """Bool [R, Q, L], True = attend: key j <= the query's position (and >= position - window[0])."""
        key = None if window is None else tuple(window)
        if key not in self._masks:
            k_pos = torch.arange(self.max_context, device=self.positions.device)[None, None, :]
            q_pos = self.query_positions[:, :, None]
            mask = k_pos <= q_pos
            if window is not None:
                mask = mask & (k_pos >= q_pos - window[0])
            self._masks[key] = mask
        return self._masks[key]

    def rotary_cos_sin(self, rotary: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, 1, d] of `rotary` (a RotaryEmbedding) at each token's own position (cached per step)."""
        key = (id(rotary), dtype)
        if key not in self._rotary:
            cos, sin = rotary.cos_sin(self.max_context, 0, self.positions.device, dtype)
            self._rotary[key] = (cos[self.positions], sin[self.positions])
        return self._rotary[key]

    def write(self, layer_number: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store this step's per-token tensors ([T, ...] each) in the layer's pool; returns the pool tensors."""
        pools = self.cache.storage(layer_number, tensors)
        for pool, t in zip(pools, tensors):
            pool.index_copy_(0, self.write_slots, t.to(pool.dtype))
        return pools

    def gather(self, pool: torch.Tensor) -> torch.Tensor:
        """Each request's context from a pool tensor: [R, L, ...] (positions past a request's length: junk, masked)."""
        r, length = self.read_slots.shape
        return pool.index_select(0, self.read_slots.reshape(-1)).view((r, length) + tuple(pool.shape[1:]))

    def pad_queries(self, t: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [R, Q, ...] (padding rows repeat token 0 and are discarded by `unpad`)."""
        if self.decode_only:
            return t.unsqueeze(1)
        return t[self.query_index]

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """[R, Q, ...] -> [T, ...]: the real query rows, in token order."""
        if self.decode_only:
            return t.squeeze(1)
        return t.flatten(0, 1).index_select(0, self.valid_index)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: torch.Tensor, scale: float,
                    bias: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v per request: q [R, Q, np, d], k [R, L, ng, d], v [R, L, ng, dv] (ng divides
    np: grouped-query attention), attend bool [R, Q, L], bias [np, L] (ALiBi) or None, sink [np] (attention-sink
    logits) or None -> [R, Q, np, dv]. SDPA without sinks; with them the explicit fp32 softmax over [scores, sink]."""
    np_, ng = q.size(2), k.size(2)
    if ng != np_:
        k = k.repeat_interleave(np_ // ng, dim=2)
        v = v.repeat_interleave(np_ // ng, dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [R, heads, Q|L, d]
    mask = attend[:, None]  # [R, 1, Q, L]
    if bias is not None:  # additive float mask: the bias where attending, -inf where masked
        mask = torch.where(mask, bias.to(q.dtype)[None, :, None, :], float("-inf"))
    if sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores + mask if bias is not None else scores.masked_fill(~mask, float("-inf"))
    probs = softmax_with_sink(scores, sink.float())
    return torch.matmul(probs.to(v.dtype), v).transpose(1, 2)
