"""Context parallelism: attention over a sequence split across the ranks of a context-parallel (CP) group.

Layout (Megatron-LM's load balancing for causal masks): the sequence of S tokens is cut into 2N chunks of
c = S / (2N); CP rank r holds chunks r and 2N-1-r, concatenated ([chunk r; chunk 2N-1-r], 2c tokens), so every rank
gets the same share of the causal triangle. `cp_positions` gives the true positions of a rank's tokens and
`slice_for_cp` cuts a full-sequence tensor to them.

Three ways to compute attention over the whole sequence from each rank's slice (`context_parallel_attention`):

* ``p2p`` (ring attention): K/V travel around the ring with point-to-point send/recv (`batch_isend_irecv`), the
  next block's transfer overlapped with the current block's computation; blocks are merged with the log-sum-exp
  (online softmax) rule; a causal block is full, diagonal-causal or skipped per pair of chunks. Without a Megatron
  mask (causal or none) a block on CPU runs torch's flash-attention kernel (output and log-sum-exp; its backward
  from the final output and log-sum-exp); with a mask, explicit fp32 math over query tiles. The backward pass
  (a custom autograd function) sends K/V around again, recomputes each block's probabilities from the saved
  softmax statistics, and returns the gradients of K/V to their owners with the accumulator travelling with them.
* ``all_gather``: K/V are gathered from every rank; local queries attend to all keys.
* ``a2a`` (DeepSpeed-Ulysses): an all-to-all scatters heads and gathers the sequence, each rank computes whole-
  sequence attention on heads/N heads, and a second all-to-all restores the layout (heads must divide by N).

Masks follow Megatron: bool, True = masked; a masked score is filled with -10000 (a fully masked row gets the uniform
softmax, the mean of V, as Megatron's softmax does; with `causal` too, uniform over its causal past only -- a
case GPT masks never produce, the diagonal stays visible); causal masking is built from positions and never materialised
as an S x S tensor. Tensors are [s, b, heads, head_dim] (Megatron's order); K/V may have fewer heads (GQA/MQA).
Process groups are explicit arguments; this module imports only torch.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

Group = Any
COMM_TYPES = ("p2p", "all_gather", "a2a")
_MASK_FILL = -10000.0  # Megatron's attention_mask_func
OVERLAP = True  # False: wait for each ring transfer before computing (tools/benchmarks/bench_context_parallel.py)


# ---- layout ----------------------------------------------------------------------------------------------------
def _size_rank(group: Group) -> Tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_cp_layout(seq_length: int, cp_size: int) -> None:
    """One-line error unless the sequence splits into 2 * cp_size equal chunks."""
    if cp_size > 1 and seq_length % (2 * cp_size) != 0:
        raise ValueError(f"--seq-length ({seq_length}) must be divisible by {2 * cp_size} (2 x "
                         f"--context-parallel-size {cp_size}): each context-parallel rank holds 2 of {2 * cp_size} "
                         "equal chunks")


def cp_chunk_ids(cp_size: int, cp_rank: int) -> Tuple[int, int]:
    """The two chunk indices (of 2N) held by CP rank r: (r, 2N-1-r)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(seq_length: int, cp_size: int, cp_rank: int, device: Any = None) -> torch.Tensor:
    """True positions (long [2c]) of the tokens CP rank r holds: chunk r then chunk 2N-1-r."""
    check_cp_layout(seq_length, cp_size)
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    c = seq_length // (2 * cp_size)
    a, b = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def slice_for_cp(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's part of a full-sequence tensor along `dim` (chunks r and 2N-1-r of 2N)."""
    if cp_size == 1:
        return t
    check_cp_layout(t.size(dim), cp_size)
    chunks = t.chunk(2 * cp_size, dim=dim)
    a, b = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def describe_cp_layout(seq_length: int, cp_size: int, comm_type: str) -> str:
    """The one log line saying how the sequence is split."""
    c = seq_length // (2 * cp_size)
    parts = "; ".join(f"rank {r}: chunks {r} and {2 * cp_size - 1 - r}" for r in range(min(cp_size, 4)))
    more = "; ..." if cp_size > 4 else ""
    return (f"> context parallel: size {cp_size}, attention {comm_type}; sequence {seq_length} in {2 * cp_size} "
            f"chunks of {c} tokens, {2 * c} per rank ({parts}{more})")


# ---- block math (fp32-exact reference formulas, no dropout) -----------------------------------------------------
def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, ng, s, d] -> [b, heads, s, d], each K/V group repeated for its query heads."""
    ng = t.size(1)
    return t if ng == heads else t.repeat_interleave(heads // ng, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient [b, heads, s, d] of an expanded K/V -> [b, groups, s, d] (sum over each group's heads)."""
    b, h, s, d = t.shape
    return t if h == groups else t.view(b, groups, h // groups, s, d).sum(dim=2)


def _block_masks(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
                 mask: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(causal -inf mask [sq, sk] or None, Megatron mask block or None) for one block."""
    future = (k_pos[None, :] > q_pos[:, None]) if causal else None
    if future is not None and not bool(future.any()):
        future = None
    return future, mask


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, future: Optional[torch.Tensor],
            mask: Optional[torch.Tensor]) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, h, sq, sk]
    if mask is not None:
        s = s.masked_fill(mask, _MASK_FILL)
    if future is not None:
        s = s.masked_fill(future, float("-inf"))
    return s


def _block_forward(q, k, v, scale, future, mask) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normalised output [b, h, sq, d], row max m, row sum l of exp(s - m)) of q against one K/V block.

    The softmax statistics are kept as (m, l) rather than one log-sum-exp: a row of -10000 fills (Megatron's masked
    scores) would lose ~1e-3 in an fp32 log-sum-exp near -10000, while s - m stays exact."""
    s = _scores(q, k, scale, future, mask)
    m = s.amax(dim=-1)
    e = torch.exp(s - m.unsqueeze(-1))
    lsum = e.sum(dim=-1)
    return torch.matmul(e, v) / lsum.unsqueeze(-1), m, lsum


def _merge(acc: Optional[tuple], blk: tuple) -> tuple:
    """Online-softmax merge of two partial results (out, m, l) over disjoint key sets."""
    if acc is None:
        return blk
    (o1, m1, l1), (o2, m2, l2) = acc, blk
    m = torch.maximum(m1, m2)
    w1, w2 = l1 * torch.exp(m1 - m), l2 * torch.exp(m2 - m)
    total = w1 + w2
    return (o1 * (w1 / total).unsqueeze(-1) + o2 * (w2 / total).unsqueeze(-1)), m, total


def _block_backward(q, k, v, dout, m, lsum, delta, scale, future, mask):
    """(dq, dk, dv) of one block given the final row statistics (m, l) and delta = rowsum(dout * out)."""
    s = _scores(q, k, scale, future, mask)
    p = torch.exp(s - m.unsqueeze(-1)) / lsum.unsqueeze(-1)
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    if mask is not None:
        ds = ds.masked_fill(mask, 0.0)  # masked_fill passes no gradient to masked scores
    ds = ds * scale
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv


# ---- p2p ring ---------------------------------------------------------------------------------------------------
class _Ring:
    """Neighbour exchange on a CP group: send to rank+1, receive from rank-1 (asynchronous, batched)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.size, self.rank = _size_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: List[torch.Tensor]) -> Tuple[list, List[torch.Tensor]]:
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, buf, self.prev, self.group) for buf in bufs]
        reqs = dist.batch_isend_irecv(ops)
        if not OVERLAP:
            self.wait(reqs)
            reqs = []
        return reqs, bufs

    @staticmethod
    def wait(reqs: list) -> None:
        for req in reqs:
            req.wait()


_TILE_ROWS = 1024  # query rows per block computation: bounds the transient scores to 1024 x c per head


def _pieces(s_local: int) -> List[slice]:
    """The two chunks of this rank's slice (key blocks)."""
    c = s_local // 2
    return [slice(0, c), slice(c, 2 * c)]


def _q_tiles(s_local: int) -> List[slice]:
    """Query tiles of at most _TILE_ROWS rows, never crossing the boundary between the two chunks."""
    c = s_local // 2
    return [slice(start + i, start + min(i + _TILE_ROWS, c)) for start in (0, c) for i in range(0, c, _TILE_ROWS)]


def _mask_cols(mask: Optional[torch.Tensor], cols: torch.Tensor) -> Optional[torch.Tensor]:
    return None if mask is None else mask.index_select(-1, cols)


def _flash_cpu(q: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether blocks can use torch's CPU flash-attention kernels (no Megatron mask: causal or none)."""
    return mask is None and q.device.type == "cpu" and hasattr(torch.ops.aten,
                                                                "_scaled_dot_product_flash_attention_for_cpu")


def _c(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, group, seq_len):
        # q [b, h, s, d], k/v [b, g, s, d] (this rank's two chunks), mask [b|1, 1, s, S] or None.
        ring = _Ring(group)
        n, r = ring.size, ring.rank
        heads = q.size(1)
        pos = [cp_positions(seq_len, n, src, q.device) for src in range(n)]
        my_pos = pos[r]
        fast = _flash_cpu(q, mask)  # whole-chunk blocks through the flash kernel, else tiled explicit blocks
        pieces = _pieces(q.size(2))
        tiles = pieces if fast else _q_tiles(q.size(2))
        acc: list = [None] * len(tiles)
        kv = [k, v]
        for step in range(n):
            src = (r - step) % n
            reqs, nxt = ring.start(kv) if step < n - 1 else ([], None)
            ke, ve = _expand(kv[0], heads), _expand(kv[1], heads)
            bmask = _mask_cols(mask, pos[src])
            for i, qs in enumerate(tiles):
                for ks in pieces:
                    qp, kp = my_pos[qs], pos[src][ks]
                    if causal and int(kp[0]) > int(qp[-1]):
                        continue  # the whole key chunk is in the future of every query: skipped
                    if fast:  # a chunk against itself is diagonal-causal, an earlier chunk full
                        diag = causal and int(kp[0]) == int(qp[0])
                        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                            _c(q[:, :, qs]), _c(ke[:, :, ks]), _c(ve[:, :, ks]), 0.0, diag, scale=scale)
                        blk = (o, lse, torch.ones_like(lse))
                    else:
                        future, m = _block_masks(qp, kp, causal, None if bmask is None else bmask[..., qs, ks])
                        blk = _block_forward(q[:, :, qs], ke[:, :, ks], ve[:, :, ks], scale, future, m)
                    acc[i] = _merge(acc[i], blk)
            ring.wait(reqs)
            kv = nxt
        out, rmax, rsum = (torch.cat([a[j] for a in acc], dim=2) for j in range(3))
        ctx.save_for_backward(q, k, v, out, rmax, rsum, mask)
        ctx.causal, ctx.scale, ctx.group, ctx.seq_len = causal, scale, group, seq_len
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, rmax, rsum, mask = ctx.saved_tensors
        ring = _Ring(ctx.group)
        n, r = ring.size, ring.rank
        heads, groups = q.size(1), k.size(1)
        pos = [cp_positions(ctx.seq_len, n, src, q.device) for src in range(n)]
        my_pos = pos[r]
        fast = _flash_cpu(q, mask)
        pieces = _pieces(q.size(2))
        tiles = pieces if fast else _q_tiles(q.size(2))
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1)
        lse = rmax + torch.log(rsum)  # the flash kernel's statistics
        dq = torch.zeros_like(q)
        kv = [k, v]
        dkv = None  # the accumulator of the current K/V's gradients, travelling with them
        dkv_reqs: list = []
        for step in range(n):
            src = (r - step) % n
            reqs, nxt = ring.start(kv) if step < n - 1 else ([], None)
            ke, ve = _expand(kv[0], heads), _expand(kv[1], heads)
            dke, dve = torch.zeros_like(ke), torch.zeros_like(ve)
            bmask = _mask_cols(mask, pos[src])
            for qs in tiles:
                for ks in pieces:
                    qp, kp = my_pos[qs], pos[src][ks]
                    if ctx.causal and int(kp[0]) > int(qp[-1]):
                        continue
                    if fast:  # the block's gradients from the final output and log-sum-exp (ring flash attention)
                        diag = ctx.causal and int(kp[0]) == int(qp[0])
                        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                            _c(dout[:, :, qs]), _c(q[:, :, qs]), _c(ke[:, :, ks]), _c(ve[:, :, ks]),
                            _c(out[:, :, qs]), _c(lse[:, :, qs]), 0.0, diag, scale=ctx.scale)
                    else:
                        future, m = _block_masks(qp, kp, ctx.causal, None if bmask is None else bmask[..., qs, ks])
                        gq, gk, gv = _block_backward(q[:, :, qs], ke[:, :, ks], ve[:, :, ks], dout[:, :, qs],
                                                     rmax[:, :, qs], rsum[:, :, qs], delta[:, :, qs], ctx.scale,
                                                     future, m)
                    dq[:, :, qs] += gq
                    dke[:, :, ks] += gk
                    dve[:, :, ks] += gv
            mine = [_fold(dke, groups), _fold(dve, groups)]
            ring.wait(dkv_reqs)
            if dkv is not None:
                mine = [a + b for a, b in zip(mine, dkv)]
            dkv_reqs, dkv = ring.start(mine)  # to the next rank, which holds these K/V's next visitor ... or owner
            ring.wait(reqs)
            kv = nxt
        ring.wait(dkv_reqs)  # after N hops the accumulator is back with the owner of this rank's K/V
        return dq, dkv[0], dkv[1], None, None, None, None, None


# ---- all-gather and all-to-all -----------------------------------------------------------------------------------
def _all_gather_seq(t: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    n, _ = _size_rank(group)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _GatherKV(torch.autograd.Function):
    """All-gather along `dim` (rank order); backward: the sum of every rank's gradient for this rank's slice."""

    @staticmethod
    def forward(ctx, t, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather_seq(t, group, dim)

    @staticmethod
    def backward(ctx, grad):
        n, r = _size_rank(ctx.group)
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(n, dim=ctx.dim)[r].contiguous(), None, None


def _a2a(t: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    n, _ = _size_rank(group)
    inputs = [x.contiguous() for x in t.chunk(n, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(n)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Scatter `scatter_dim` over the group, gather `gather_dim`; backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, t, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _a2a(t, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, ctx.group, ctx.dims[1], ctx.dims[0]), None, None, None


def _dense_attention(q, k, v, scale, q_pos, k_pos, causal, mask) -> torch.Tensor:
    """Megatron's explicit softmax attention (autograd-tracked): q [b, h, sq, d], k/v [b, g, sk, d]."""
    heads = q.size(1)
    future = (k_pos[None, :] > q_pos[:, None]) if causal else None
    s = _scores(q, _expand(k, heads), scale, future, mask)
    return torch.matmul(torch.softmax(s, dim=-1), _expand(v, heads))


def _natural_order(seq_len: int, n: int, device: Any) -> torch.Tensor:
    """Positions of the gathered sequence (rank 0's tokens, rank 1's, ...): its columns' true positions."""
    return torch.cat([cp_positions(seq_len, n, src, device) for src in range(n)])


# ---- entry point -------------------------------------------------------------------------------------------------
def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: Group,
    *,
    comm_type: str = "p2p",
    causal: bool = True,
    attention_mask: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of this CP rank's queries over the whole sequence: q [s, b, np, hn], k/v [s, b, ng, hn] (this
    rank's two chunks, RoPE already applied at their true positions) -> context [s, b, np * hn].

    `attention_mask`: None, or bool [b|1, 1, s, S] (True = masked): the rows of this rank's queries against all S keys
    in natural order (Megatron slices the mask's rows the same way). `causal` masks keys after each query.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {', '.join(COMM_TYPES)}, got {comm_type!r}")
    n, r = _size_rank(group)
    s, b, heads, hn = query.shape
    groups = key.size(2)
    seq_len = s * n
    check_cp_layout(seq_len, n)
    scale = 1.0 / math.sqrt(hn) if softmax_scale is None else softmax_scale
    dtype = query.dtype  # fp16/bf16 inputs: the softmax and its statistics in fp32 (Megatron's softmax-in-fp32)
    q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, h, s, d]
    if n == 1:
        pos = torch.arange(s, device=q.device)
        out = _dense_attention(q, k, v, scale, pos, pos, causal, attention_mask)
    elif comm_type == "p2p":
        out = _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), attention_mask, causal, scale,
                                   group, seq_len)
    elif comm_type == "all_gather":
        k_all, v_all = (_GatherKV.apply(t, group, 2) for t in (k, v))
        cols = _natural_order(seq_len, n, q.device)
        mask = None if attention_mask is None else attention_mask.index_select(-1, cols)
        out = _dense_attention(q, k_all, v_all, scale, cp_positions(seq_len, n, r, q.device), cols, causal, mask)
    else:
        if heads % n != 0:
            raise ValueError(f"--cp-comm-type a2a needs the attention heads per tensor-parallel rank ({heads}) to be "
                             f"divisible by --context-parallel-size ({n}); use p2p or all_gather")
        if groups % n != 0:  # too few K/V groups to scatter: give every query head its own K/V copy
            k, v = _expand(k, heads), _expand(v, heads)
        qa, ka, va = (_AllToAll.apply(t, group, 1, 2) for t in (q, k, v))  # [b, h/N, S (rank order), d]
        cols = _natural_order(seq_len, n, q.device)
        mask = None
        if attention_mask is not None:
            full = _all_gather_seq(attention_mask.to(torch.uint8), group, dim=-2).bool()  # rows in rank order
            mask = full.index_select(-1, cols)
        o = _dense_attention(qa, ka, va, scale, cols, cols, causal, mask)
        out = _AllToAll.apply(o, group, 2, 1)  # back to [b, h, s, d]
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * hn).to(dtype)
