"""A tiny Qwen3-style model with sliding-window attention (--qk-layernorm, --kv-channels 24 != 64 / 4, GQA,
--window-size 7,0 on layer 1 and global attention on layer 2 through --window-attn-skip-freq 2; seq 64) trains the
serial run's 20-step curve (losses within 1e-5 relative, grad norms) under TP=2 + SP, PP=2, CP=2 (the window's rows
built from each rank's true positions) and DP=2 with the distributed optimizer; its MoE sibling (4 experts, top-2, no
shared expert) under EP=2. The DP=2 run saves at iteration 10; resumed from there it trains iterations 11-20 and
validates bitwise as the uninterrupted run. Plain TP=2 is not run: the q/k norm grads it sums over TP (with and
without SP) are compared with TP=1 in tests/model/test_qk_layernorm_tp.py. Two launches (serial: 1 process; the
layouts: 2 processes, one after another)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.training._llama import ITERS, LLAMA, assert_matches, curve_of, run_many
from tests.training._workers import checkpoint_at, curve_from_result, tiny_gpt_argv

pytestmark = pytest.mark.slow

QWEN3_SW = [*LLAMA, "--qk-layernorm", "--kv-channels", "24", "--window-size", "7,0", "--window-attn-skip-freq", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]
HALF = ITERS // 2
DISTOPT = ["--use-distributed-optimizer"]
DENSE = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "cp2": ["--context-parallel-size", "2"],
    "dp2-distopt": DISTOPT,
}


def _run(data: dict, *extra: str) -> tuple[str, list[str]]:
    return "stage", tiny_gpt_argv(data, *QWEN3_SW, *extra, iters=ITERS)


def test_qwen3_sliding_window_layouts_match_serial_and_resume_exactly(gpt_data: dict, tmp_path: Path) -> None:
    serial = run_distributed(run_many, 1, args=([_run(gpt_data), _run(gpt_data, *MOE)],))[-1]
    dense_ref, moe_ref = curve_of(serial[0], "serial"), curve_of(serial[1], "serial MoE")
    ckpt = tmp_path / "dp2"
    at_half = checkpoint_at(ckpt, HALF, tmp_path)  # a link to the DP=2 run's save at HALF (made by that run)
    runs = [_run(gpt_data, *extra) for extra in DENSE.values()]
    runs[-1][1].extend(["--save", str(ckpt), "--save-interval", str(HALF)])
    runs.append(_run(gpt_data, *MOE, "--expert-model-parallel-size", "2"))
    runs.append(_run(gpt_data, *DISTOPT, "--load", str(at_half)))
    results = run_distributed(run_many, 2, args=(runs,))[-1]
    for i, name in enumerate(DENSE):
        assert_matches(curve_of(results[i], name), dense_ref, name)
    assert_matches(curve_of(results[len(DENSE)], "ep2"), moe_ref, "EP=2 (MoE)")
    full, resumed = (curve_from_result(results[i]["result"]) for i in (len(DENSE) - 1, len(DENSE) + 1))
    assert results[-1]["error"] is None and sorted(resumed["train"]) == list(range(HALF + 1, ITERS + 1))
    assert resumed["train"] == {it: full["train"][it] for it in resumed["train"]}, "resume is not exact"
    assert resumed["val"] and resumed["val"] == full["val"][-len(resumed["val"]):], (resumed["val"], full["val"])
