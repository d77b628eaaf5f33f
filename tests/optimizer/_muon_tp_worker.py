"""Worker of tests/optimizer/test_muon_tp.py (module level so run_distributed can pickle it)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.optimizer.muon import fp32_matmul_precision, newton_schulz, orthogonalize_tp


def shard_updates(rank: int, world_size: int) -> dict:
    """Each --muon-tp-mode's update of this rank's shard, for rows (dim 0) and columns (dim 1) splits, against the
    serial update of the whole matrix cut the same way."""
    out = {}
    group = dist.group.WORLD
    full = torch.randn(12, 20, generator=torch.Generator().manual_seed(3))
    with fp32_matmul_precision("highest"):
        serial = newton_schulz(full, 5)
        for dim in (0, 1):
            mine = full.chunk(world_size, dim=dim)[rank]
            ref = serial.chunk(world_size, dim=dim)[rank]
            for mode in ("duplicated", "distributed"):
                got = orthogonalize_tp(mine.clone(), 5, "quintic", group, dim, mode)
                out[(mode, dim)] = (got - ref).abs().max().item()
            out[("blockwise", dim)] = (newton_schulz(mine.clone(), 5) - ref).abs().max().item()
    return out
