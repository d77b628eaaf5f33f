"""BLOOM (ALiBi, --embed-layernorm) trains the serial 20-step curve (training and validation losses within 1e-5
relative, grad norms) under TP=2 + SP, PP=2, DP=2 + distributed optimizer, DeepSpeed ZeRO-1 and ZeRO-3 (DP=2), the
DeepSpeed pipeline engine (GPTModelPipe, PP=2) and TP=2 x PP=2; a TP=2 x PP=2 run stopped at iteration 10
(--exit-interval, checkpoint) and resumed reproduces iterations 11..20 exactly.

One 2-process job runs six layouts one after another and one 4-process job the TP=2 x PP=2 runs (tests/training/
_bloom.py holds the model and the serial reference).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.ds._workers import write_ds_config
from tests.training._bloom import ITERS, bloom_argv, serial_curve
from tests.training._llama import assert_matches, curve_of, run_many


@pytest.fixture(scope="module")
def serial(gpt_data: dict) -> dict:
    return serial_curve(gpt_data)


@pytest.mark.slow
def test_two_process_layouts_match_serial(serial: dict, gpt_data: dict, tmp_path: Path) -> None:
    batch = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 8}
    cfg = {stage: write_ds_config(str(tmp_path / f"zero{stage}.json"), zero_optimization={"stage": stage}, **batch)
           for stage in (0, 1, 3)}
    ds = ["--deepspeed", "--deepspeed_config"]
    runs = {
        "tp2-sp": ("stage", bloom_argv(gpt_data, "--tensor-model-parallel-size", "2", "--sequence-parallel")),
        "pp2": ("stage", bloom_argv(gpt_data, "--pipeline-model-parallel-size", "2")),
        "dp2-distopt": ("stage", bloom_argv(gpt_data, "--use-distributed-optimizer")),
        "zero1-dp2": ("stage", bloom_argv(gpt_data, *ds, cfg[1])),
        "zero3-dp2": ("stage", bloom_argv(gpt_data, *ds, cfg[3])),
        "ds-pipeline-pp2": ("pipe", bloom_argv(gpt_data, *ds, cfg[0], "--pipeline-model-parallel-size", "2")),
    }
    results = run_distributed(run_many, 2, args=(list(runs.values()),))
    for i, name in enumerate(runs):
        assert_matches(curve_of(results[-1][i], name), serial, name)


@pytest.mark.slow
def test_tp2_pp2_matches_serial_and_resumes_exactly(serial: dict, gpt_data: dict, tmp_path: Path) -> None:
    tp2pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    half = ITERS // 2
    ckpt = str(tmp_path / "ckpt")
    runs = [
        ("stage", bloom_argv(gpt_data, *tp2pp2)),
        ("stage", bloom_argv(gpt_data, *tp2pp2, "--save", ckpt, "--save-interval", str(half),
                             "--exit-interval", str(half))),
        ("stage", bloom_argv(gpt_data, *tp2pp2, "--load", ckpt)),
    ]
    results = run_distributed(run_many, 4, args=(runs,))[-1]
    full = curve_of(results[0], "tp2-pp2")
    assert_matches(full, serial, "TP=2 x PP=2")
    first = curve_of(results[1], "tp2-pp2 first half")
    assert sorted(first["train"]) == list(range(1, half + 1))
    again = curve_of(results[2], "tp2-pp2 resumed")
    assert sorted(again["train"]) == list(range(half + 1, ITERS + 1))
    for it in range(1, ITERS + 1):  # identical to the last printed digit
        part = first if it <= half else again
        assert part["train"][it] == full["train"][it], (it, full["train"][it], part["train"][it])
    assert again["val"][-1] == full["val"][-1]
