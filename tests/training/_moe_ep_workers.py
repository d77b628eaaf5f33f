"""Worker of tests/training/test_moe_expert_parallel.py: several steps in one process group (module level so
`run_distributed` can pickle it): ("train", argv) runs pretrain_gpt from the serial model's initial weights,
("tracker", dir, iteration) points a checkpoint's tracker at an earlier iteration, ("convert", argv) runs
tools/checkpoint/convert.py; the last two on rank 0, then every rank waits."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.training._llama import run_many


def run_steps(rank: int, world_size: int, steps: list[tuple]) -> list[Any]:
    out: list[Any] = []
    for step in steps:
        if step[0] == "train":
            out.append(run_many(rank, world_size, [("stage", step[1])])[0])
            continue
        if rank == 0:
            if step[0] == "tracker":
                (Path(step[1]) / "latest_checkpointed_iteration.txt").write_text(str(step[2]))
            else:
                from megatron.checkpoint.conversion.driver import main as convert

                convert(step[1])
        dist.barrier()
        out.append(None)
    return out
