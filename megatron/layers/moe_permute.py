"""Row permutations of the MoE layer (tokens -> rows by expert -> padded expert groups, and back) whose forward and
backward are both gathers.

Autograd's backward of ``index_select`` is ``index_add`` (a scatter; on CPU under deterministic algorithms a
``scatter_add`` over an expanded index), which cost more than the expert GEMMs' padding. Every permutation here
knows its inverse, so the backward gathers too:

  `dispatch(src, index, table)`  out[i] = src[index[i]] (index == len(src): a zero row);
                                 grad_src[r] = sum_j grad_out[table[r, j]] (table == len(out): nothing), j ascending;
  `combine(src, table, index)`   the transpose: out[r] = sum_j src[table[r, j]], grad_src[i] = grad_out[index[i]].

The sums run over j in order starting from the first term, so they equal ``zeros.index_add(0, index, rows)`` bitwise
when `table` lists each target's rows in the order index_add visits them (row order).
"""
from __future__ import annotations

from typing import Any

import torch


def gather_rows(src: torch.Tensor, index: torch.Tensor, padded: bool) -> torch.Tensor:
    """src[index] along dim 0; with `padded`, index == len(src) reads a zero row."""
    if padded:
        src = torch.cat((src, src.new_zeros((1,) + src.shape[1:])))
    return src.index_select(0, index)


def sum_rows(src: torch.Tensor, table: torch.Tensor, padded: bool) -> torch.Tensor:
    """out[r] = src[table[r, 0]] + src[table[r, 1]] + ... (left to right); table == len(src) adds a zero row."""
    rows = gather_rows(src, table.reshape(-1), padded).view(table.shape + src.shape[1:])
    out = rows[:, 0]
    for j in range(1, table.size(1)):
        out = out + rows[:, j]
    return out.contiguous()


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, index: torch.Tensor, table: torch.Tensor, index_padded: bool,
                table_padded: bool) -> torch.Tensor:
        ctx.save_for_backward(table)
        ctx.table_padded = table_padded
        return gather_rows(src, index, index_padded)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (table,) = ctx.saved_tensors
        return sum_rows(grad.contiguous(), table, ctx.table_padded), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, table: torch.Tensor, index: torch.Tensor, table_padded: bool,
                index_padded: bool) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.index_padded = index_padded
        return sum_rows(src, table, table_padded)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return gather_rows(grad.contiguous(), index, ctx.index_padded), None, None, None, None


def dispatch(src: torch.Tensor, index: torch.Tensor, table: torch.Tensor, index_padded: bool,
             table_padded: bool) -> torch.Tensor:
    """Rows src[index] (a zero row where index == len(src)); `table` [len(src), K] lists, for each source row, the
    output rows that read it (len(index) where fewer than K do)."""
    return _Dispatch.apply(src, index, table, index_padded, table_padded)


def combine(src: torch.Tensor, table: torch.Tensor, index: torch.Tensor, table_padded: bool,
            index_padded: bool) -> torch.Tensor:
    """out[r] = sum of src[table[r, :]] in column order; `index` [len(src)] names the output row each source row
    goes to (len(table) for rows that go nowhere)."""
    return _Combine.apply(src, table, index, table_padded, index_padded)


def inverse_table(targets: torch.Tensor, size: int) -> tuple[torch.Tensor, bool]:
    """For targets[i] in [0, size): table [size, K] of the i with targets[i] == r, ascending, padded with
    len(targets); and whether any padding was needed."""
    n = targets.numel()
    counts = torch.bincount(targets, minlength=size)
    width = int(counts.max()) if n else 0
    order = torch.argsort(targets, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(n) - starts[targets[order]]
    table = torch.full((size, max(width, 1)), n, dtype=torch.long)
    table[targets[order], column] = order
    return table, bool((counts < width).any()) or width == 0
