"""A Llama-style tiny model (RMSNorm, SwiGLU, RoPE, GQA with 2 groups, untied output, no biases) trains the same
12-step curve as the serial run (training and validation losses within 1e-5 relative, grad norms) under TP=2 + SP,
PP=2, DP=2 + distributed optimizer + --overlap-grad-reduce + --overlap-param-gather, PP=4 interleaved (2 virtual
chunks per stage) and TP=2 x PP=2; resuming TP=2 x PP=2 at iteration 6 reproduces iterations 7..12 exactly.

One 2-process job and one 4-process job run the layouts one after another (tests/training/_llama.py); the serial
reference is computed once per session. DeepSpeed layouts: tests/ds/test_llama_ds.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.training._llama import ITERS, assert_matches, curve_of, llama_argv, run_many, serial_curve

TWO = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2-distopt-overlaps": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                             "--ddp-bucket-size", "20000"],
}


@pytest.fixture(scope="module")
def serial(gpt_data: dict) -> dict:
    return serial_curve(gpt_data)


def test_two_process_layouts_match_serial(serial: dict, gpt_data: dict) -> None:
    runs = [("stage", llama_argv(gpt_data, *extra)) for extra in TWO.values()]
    results = run_distributed(run_many, 2, args=(runs,))
    for i, name in enumerate(TWO):
        assert_matches(curve_of(results[-1][i], name), serial, name)
    assert curve_of(results[0][1], "pp2 first stage")["train"] == {}  # only the last stage prints losses


def test_pp4_interleaved_and_tp2_pp2_match_serial_and_resume_exactly(serial: dict, gpt_data: dict,
                                                                    tmp_path: Path) -> None:
    tp2pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    half = ITERS // 2
    runs = [
        ("stage", llama_argv(gpt_data, "--pipeline-model-parallel-size", "4",
                             "--num-layers-per-virtual-pipeline-stage", "1")),
        ("stage", llama_argv(gpt_data, *tp2pp2, "--save", str(tmp_path / "a"), "--save-interval", str(half))),
    ]
    first = run_distributed(run_many, 4, args=(runs,))
    assert_matches(curve_of(first[-1][0], "pp4-interleaved"), serial, "PP=4 interleaved")
    full = curve_of(first[-1][1], "tp2-pp2")
    assert_matches(full, serial, "TP=2 x PP=2")
    assert sorted(p.name for p in (tmp_path / "a" / f"iter_{half:07d}").iterdir() if p.is_dir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    # Pretend the run stopped after iteration 6 and resume from there.
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text(str(half))
    resume = [("stage", llama_argv(gpt_data, *tp2pp2, "--load", str(tmp_path / "a")))]
    (again,) = run_distributed(run_many, 4, args=(resume,))[-1]
    again = curve_of(again, "tp2-pp2 resumed")
    assert sorted(again["train"]) == list(range(half + 1, ITERS + 1))
    for it in range(half + 1, ITERS + 1):  # identical to the last printed digit
        assert again["train"][it] == full["train"][it], (it, full["train"][it], again["train"][it])
    assert again["val"] == full["val"][1:]
