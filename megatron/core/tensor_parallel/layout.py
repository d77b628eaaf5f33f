"""How a parameter is split over tensor-parallel ranks, described by the parameter itself (`param.tp_layout`).

The tensor-parallel layers attach a `TensorParallelLayout` to every parameter they create; layers with fused
weights refine it (SwiGLU's ``dense_h_to_4h`` holds ``[gate; up]`` per rank, GQA's ``query_key_value`` keeps each
KV group ``[q of the group's heads; k; v]`` on one rank). Resharding a checkpoint (`split` / `merge`) follows the
description, so every architecture variant reshards correctly without name tables.

Convention: the *full* tensor is the TP=1 layout. With ``blocks = n`` it is ``[B_0; ...; B_{n-1}]`` along `dim`
and rank r holds ``[B_0[r]; ...; B_{n-1}[r]]`` (each block chunked over the ranks); ``unit`` rows (a KV group)
must never be cut by a rank boundary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class TensorParallelLayout:
    """Split description of one parameter: `dim` None means replicated on every TP rank."""

    dim: Optional[int] = None
    blocks: int = 1
    unit: int = 1
    structure: str = ""

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def describe(self) -> str:
        if self.dim is None:
            return "replicated"
        text = f"split along dim {self.dim}"
        if self.blocks > 1:
            text += f" in {self.blocks} blocks per rank"
        if self.structure:
            text += f" ({self.structure})"
        return text

    def _check(self, name: str, size: int, tp_size: int) -> None:
        per_rank_block, rest = divmod(size, self.blocks * tp_size)
        if rest or per_rank_block % self.unit:
            raise ValueError(
                f"{name}: size {size} along dim {self.dim} is not divisible by tensor parallel size {tp_size} "
                f"into whole units ({self.describe()}; {self.blocks} block(s), {self.unit} rows per unit)"
            )

    def split(self, full: torch.Tensor, tp_size: int, name: str = "parameter") -> list[torch.Tensor]:
        """The full (TP=1) tensor -> `tp_size` shards in rank order (fresh, contiguous tensors)."""
        if self.dim is None:
            return [full for _ in range(tp_size)]
        self._check(name, full.size(self.dim), tp_size)
        blocks = [b.chunk(tp_size, dim=self.dim) for b in full.chunk(self.blocks, dim=self.dim)]
        return [torch.cat([b[r] for b in blocks], dim=self.dim).clone() for r in range(tp_size)]

    def merge(self, shards: Sequence[torch.Tensor], name: str = "parameter") -> torch.Tensor:
        """Shards in rank order -> the full (TP=1) tensor."""
        if self.dim is None:
            return shards[0]
        for rank, s in enumerate(shards):
            if s.size(self.dim) % self.blocks:
                raise ValueError(f"{name}: shard {rank} size {s.size(self.dim)} is not {self.blocks} equal blocks")
        pieces = [s.chunk(self.blocks, dim=self.dim) for s in shards]
        return torch.cat([pieces[r][i] for i in range(self.blocks) for r in range(len(shards))], dim=self.dim)


REPLICATED = TensorParallelLayout()


def set_tp_layout(param: torch.Tensor, layout: TensorParallelLayout) -> None:
    """Attach (or refine) the split description of `param`."""
    param.tp_layout = layout


def get_tp_layout(param: torch.Tensor) -> TensorParallelLayout:
    """The split description of `param` (replicated when it has none)."""
    return getattr(param, "tp_layout", REPLICATED)
