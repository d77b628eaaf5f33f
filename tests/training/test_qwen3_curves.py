"""A tiny Qwen3-style model with sliding-window attention (--qk-layernorm, --kv-channels 24 != 64 / 4, GQA,
--window-size 7,0 on layer 1 and global attention on layer 2 through --window-attn-skip-freq 2; seq 64) trains the
serial run's 20-step curve (losses within 1e-5 relative, grad norms) under TP=2 + SP, TP=2 without SP (the q/k norm
grads are summed over TP either way), PP=2 and CP=2 (the window's rows built from each rank's true positions); its
MoE sibling (4 experts, top-2, no shared expert) under EP=2. Two 2-process launches, the layouts one after another."""
from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.training._llama import ITERS, LLAMA, assert_matches, curve_of, run_many
from tests.training._workers import tiny_gpt_argv

pytestmark = pytest.mark.slow

QWEN3_SW = [*LLAMA, "--qk-layernorm", "--kv-channels", "24", "--window-size", "7,0", "--window-attn-skip-freq", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]
DENSE = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "cp2": ["--context-parallel-size", "2"],
}


def _run(data: dict, *extra: str) -> tuple[str, list[str]]:
    return "stage", tiny_gpt_argv(data, *QWEN3_SW, *extra, iters=ITERS)


def test_qwen3_sliding_window_layouts_match_serial(gpt_data: dict) -> None:
    serial = run_distributed(run_many, 1, args=([_run(gpt_data), _run(gpt_data, *MOE)],))[-1]
    dense_ref, moe_ref = curve_of(serial[0], "serial"), curve_of(serial[1], "serial MoE")
    runs = [_run(gpt_data, *extra) for extra in DENSE.values()]
    runs.append(_run(gpt_data, *MOE, "--expert-model-parallel-size", "2"))
    results = run_distributed(run_many, 2, args=(runs,))[-1]
    for i, name in enumerate(DENSE):
        assert_matches(curve_of(results[i], name), dense_ref, name)
    assert_matches(curve_of(results[-1], "ep2"), moe_ref, "EP=2 (MoE)")
