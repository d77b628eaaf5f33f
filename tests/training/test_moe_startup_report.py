"""An EP2 training run's start-up output (pretrain_gpt, gloo CPU): rank 0 prints the expert-parallel layout and a
parameter report that counts the experts (total, routed experts per rank, active, most loaded shard = rank 0)."""
from __future__ import annotations

import re

from tests.dist_utils import run_distributed
from tests.training._llama import run_many
from tests.training._workers import tiny_gpt_argv
from tests.training.test_moe_training import MOE


def _count(label: str, text: str) -> int:
    return int(re.search(label + r" in billions: \S+ \((\d+)\)", text).group(1))


def test_ep2_start_up_prints_the_layout_and_counts_the_experts(gpt_data: dict) -> None:
    argv = tiny_gpt_argv(gpt_data, *MOE, "--expert-model-parallel-size", "2", iters=3)
    (rank0,), _ = run_distributed(run_many, 2, args=([("stage", argv)],))
    assert rank0["error"] is None, rank0["error"]
    out = rank0["stdout"]
    assert ("> expert parallel: size 2, expert-tensor-parallel size 1, expert-data-parallel size 1; 4 experts per MoE "
            "layer, 2 per rank (rank 0: experts 0-1; rank 1: experts 2-3)") in out
    total, experts = _count("Total number of parameters", out), _count("Number of parameters in routed experts", out)
    active = _count("Total number of active parameters", out)
    shard = _count("Number of parameters in most loaded shard", out)
    # one MoE layer of 4 SwiGLU experts (h 32, ffn 48): 4 x 3 x 32 x 48 routed, top-2 of them active
    assert experts == 4 * 3 * 32 * 48 and total - active == 2 * 3 * 32 * 48
    assert shard == total - experts // 2 and "per rank over expert-parallel size 2" in out
