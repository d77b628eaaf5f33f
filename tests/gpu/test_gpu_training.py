"""Training on a GPU (skipped without CUDA): fp16 dynamic loss scaling through a real overflow, bf16 and fp32 steps
over NCCL at world size 1, deterministic mode bitwise, checkpoints moving GPU -> CPU -> GPU, DeepSpeed ZeRO-1/2/3."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.ds._workers import write_ds_config
from tests.gpu.helpers import GPU, check_ok, pretrain_runs
from tests.training._workers import tiny_gpt_argv

pytestmark = GPU


def test_fp16_overflow_is_skipped_counted_and_halves_the_scale(gpt_data: dict, tmp_path: Path) -> None:
    # A 2^40 loss scale overflows the fp16 gradients for sure: each such iteration is skipped, counted on its log
    # line, and (hysteresis 1) halves the scale, until the gradients fit; then the scale stays (window 1000).
    argv = tiny_gpt_argv(gpt_data, "--fp16", "--initial-loss-scale", str(2.0**40), "--hysteresis", "1",
                         "--loss-scale-window", "1000", iters=24)
    run = pretrain_runs([argv], tmp_path)[0]
    check_ok(run)
    assert run["backend"] == "nccl"
    log = run["log"]
    assert sorted(log) == list(range(1, 25))
    scale = 2.0**40
    for it in range(1, 25):
        line = log[it]
        expected = scale / 2 if line["skipped"] else scale
        assert line["scale"] == expected, (it, line)
        scale = expected
        if not line["skipped"]:
            assert line["loss"] is not None and math.isfinite(line["loss"])
    skipped = sum(int(log[it]["skipped"]) for it in log)
    assert skipped >= 1 and log[24]["skipped"] == 0
    assert scale == 2.0 ** (40 - skipped)


def test_bf16_and_fp32_steps_over_nccl(gpt_data: dict, tmp_path: Path) -> None:
    fp32, bf16 = pretrain_runs([tiny_gpt_argv(gpt_data, iters=10), tiny_gpt_argv(gpt_data, "--bf16", iters=10)],
                               tmp_path)
    for run in (fp32, bf16):
        check_ok(run)
        assert run["backend"] == "nccl" and run["device"] == "cuda"
    assert fp32["log"][10]["loss"] < fp32["log"][1]["loss"]
    for it in range(1, 11):
        assert bf16["log"][it]["loss"] == pytest.approx(fp32["log"][it]["loss"], rel=2e-2), it


def test_deterministic_mode_is_bitwise(gpt_data: dict, tmp_path: Path) -> None:
    argv = tiny_gpt_argv(gpt_data, "--deterministic-mode", "--bf16", "--hidden-dropout", "0.1",
                         "--attention-dropout", "0.1", iters=8)
    a, b = pretrain_runs([argv, argv], tmp_path)
    check_ok(a)
    check_ok(b)
    assert a["log"] == b["log"] and len(a["log"]) == 8


def test_checkpoint_moves_gpu_to_cpu_and_back(gpt_data: dict, tmp_path: Path) -> None:
    first, second = str(tmp_path / "gpu"), str(tmp_path / "cpu")
    base = ["--eval-iters", "0", "--save-interval", "1000", "--lr-decay-iters", "8", "--override-opt_param-scheduler"]
    for sub in "abc":
        (tmp_path / sub).mkdir()
    straight = pretrain_runs([tiny_gpt_argv(gpt_data, *base, iters=8)], tmp_path / "a")[0]
    check_ok(straight)
    gpu = pretrain_runs([tiny_gpt_argv(gpt_data, *base, "--save", first, iters=4)], tmp_path)[0]
    check_ok(gpu)
    cpu = pretrain_runs([tiny_gpt_argv(gpt_data, *base, "--load", first, "--save", second, iters=6)],
                        tmp_path / "b", env={"CUDA_VISIBLE_DEVICES": ""})[0]
    check_ok(cpu)
    assert cpu["device"] == "cpu" and cpu["backend"] == "gloo"
    back = pretrain_runs([tiny_gpt_argv(gpt_data, *base, "--load", second, iters=8)], tmp_path / "c")[0]
    check_ok(back)
    assert sorted(cpu["log"]) == [5, 6] and sorted(back["log"]) == [7, 8]
    for run in (cpu, back):
        for it, line in run["log"].items():
            assert line["loss"] == pytest.approx(straight["log"][it]["loss"], rel=1e-4), it


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_deepspeed_zero_stages_at_world_size_one(gpt_data: dict, tmp_path: Path, dtype: str) -> None:
    pytest.importorskip("deepspeed")
    extra = ["--bf16"] if dtype == "bf16" else []
    cfgs = [write_ds_config(str(tmp_path / f"zero{stage}.json"), zero_optimization={"stage": stage},
                            **({"bf16": {"enabled": True}} if dtype == "bf16" else {})) for stage in (1, 2, 3)]
    runs = [tiny_gpt_argv(gpt_data, *extra, iters=6)]
    runs += [tiny_gpt_argv(gpt_data, "--deepspeed", "--deepspeed_config", cfg, *extra, iters=6) for cfg in cfgs]
    results = pretrain_runs(runs, tmp_path)
    for run in results:
        check_ok(run)
    reference = results[0]["log"]
    for stage, run in zip((1, 2, 3), results[1:]):
        assert sorted(run["log"]) == list(range(1, 7)), stage
        for it in range(1, 7):
            rel = 1e-4 if dtype == "fp32" else 2e-2
            assert run["log"][it]["loss"] == pytest.approx(reference[it]["loss"], rel=rel), (stage, it)
