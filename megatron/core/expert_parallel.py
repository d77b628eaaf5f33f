"""Collectives of the expert-parallel token dispatch (megatron/layers/moe.py), differentiable where tokens flow.

`all_to_all(x, out_splits, in_splits, group)`: rows of `x` split by `in_splits` go to the ranks of `group` in order;
the result holds `out_splits[r]` rows from rank r. Backward is the reverse all-to-all of the gradient.
`exchange_counts(counts, group)`: per-(destination rank, local expert) token counts [ep, L] -> the counts each source
rank sends to this rank's experts [ep, L] (no gradient).
`describe_ep_layout(...)`: the start-up line saying which experts each expert-parallel rank holds.
"""
from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: Any) -> torch.Tensor:
    """Variable-size all-to-all of the rows of `x` over `group` (autograd: the reverse all-to-all)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """counts [ep, L] (tokens this rank sends to rank r's local expert l) -> [ep, L] (tokens rank s sends to mine)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def describe_ep_layout(num_experts: int, ep_size: int, etp_size: int, edp_size: int) -> str:
    """The one log line saying how each MoE layer's experts are split over the expert-parallel ranks."""
    local = num_experts // ep_size
    parts = "; ".join(f"rank {r}: experts {r * local}-{(r + 1) * local - 1}" if local > 1 else f"rank {r}: expert {r}"
                      for r in range(min(ep_size, 4)))
    more = "; ..." if ep_size > 4 else ""
    return (f"> expert parallel: size {ep_size}, expert-tensor-parallel size {etp_size}, expert-data-parallel size "
            f"{edp_size}; {num_experts} experts per MoE layer, {local} per rank ({parts}{more}); the rest of the "
            "model is replicated over the expert-parallel ranks")
