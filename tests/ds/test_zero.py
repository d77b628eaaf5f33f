"""ZeRO-1/2/3 through deepspeed.initialize equal Megatron's own data parallelism (fp32, CPU, gloo), TP x ZeRO, and
DeepSpeed activation checkpointing replays dropout exactly.

One 2-process job (DeepSpeed imported once per process) runs, one after another:
  0. the non-DeepSpeed DP=2 reference,
  1-3. ZeRO-1, ZeRO-2, ZeRO-3 (DP=2) (and 11. ZeRO stage 0: DeepSpeed's plain data parallelism),
  4. TP=2 x ZeRO-1 (DP=1; DeepSpeed's grad-norm/clipping goes through our mpu adapter),
  5-7. TP=2 x ZeRO-1 with dropout on: no recomputation, --checkpoint-activations with
       --deepspeed-activation-checkpointing, and the same with --partition-activations,
  8-9. --rampup-batch-size without and with ZeRO-2 (engine.set_train_batch_size on every batch-size change),
  10. ZeRO-1 with bf16 from the config (4 iterations; close to fp32, not equal).
A 4-process job runs TP=2 x ZeRO-2 over DP=2. Megatron's DP=2 equals the serial run (tests/training), so every
curve here is compared with run 0: losses within 1e-5 relative at every iteration and at the validation points.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.ds._workers import parse_losses, run_pretrain_ds, tiny_gpt_argv, write_ds_config

REL = 1e-5
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
PARAMS_NORM_RE = re.compile(r"\| params norm: ([0-9.]+) \|")
GRAD_NORM_RE = re.compile(r"\| grad norm: ([0-9.]+) \|")


def _assert_close(curve: dict, ref: dict, what: str) -> None:
    assert sorted(curve["train"]) == sorted(ref["train"]) and len(ref["train"]) == 20, f"{what}: iterations differ"
    for it, loss in ref["train"].items():
        assert math.isclose(curve["train"][it], loss, rel_tol=REL), \
            f"{what}: iteration {it}: {curve['train'][it]} vs {loss}"
    assert [p for p, _ in curve["val"]] == [p for p, _ in ref["val"]] and ref["val"], f"{what}: validation differs"
    for (p, a), (_, b) in zip(curve["val"], ref["val"]):
        assert math.isclose(a, b, rel_tol=REL), f"{what}: validation at {p}: {a} vs {b}"


def _runs(rank: int, world_size: int, runs: list[list[str]]) -> list[dict]:
    """Several pretrain_gpt runs in one process (DeepSpeed imported once)."""
    return [run_pretrain_ds(rank, world_size, argv) for argv in runs]


def _rampup_argv(gpt_data: dict, *extra: str) -> list[str]:
    """The tiny GPT with Megatron-DeepSpeed's batch ramp-up (2 → 16 by 2 over 60 samples, 200 samples = 20 iters)."""
    argv = tiny_gpt_argv(gpt_data)
    for flag in ("--train-iters", "--micro-batch-size", "--global-batch-size", "--lr-warmup-iters"):
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv + ["--micro-batch-size", "1", "--global-batch-size", "16", "--rampup-batch-size", "2", "2", "60",
                   "--train-samples", "200", "--lr-warmup-samples", "5", *extra]


@pytest.fixture(scope="module")
def curves(gpt_data: dict, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("zero")
    cfg = {stage: write_ds_config(str(tmp / f"ds_zero{stage}.json"), zero_optimization={"stage": stage})
           for stage in (0, 1, 2, 3)}
    ds = ["--deepspeed", "--deepspeed_config"]
    tp2 = ["--tensor-model-parallel-size", "2"]
    ckpt = ["--checkpoint-activations", "--deepspeed-activation-checkpointing"]
    norm = "--log-params-norm"
    runs = [
        tiny_gpt_argv(gpt_data, norm),
        tiny_gpt_argv(gpt_data, *ds, cfg[1], norm),
        tiny_gpt_argv(gpt_data, *ds, cfg[2]),
        tiny_gpt_argv(gpt_data, *ds, cfg[3], norm),
        tiny_gpt_argv(gpt_data, *ds, cfg[1], *tp2),
        tiny_gpt_argv(gpt_data, *ds, cfg[1], *tp2, *DROPOUT),
        tiny_gpt_argv(gpt_data, *ds, cfg[1], *tp2, *DROPOUT, *ckpt),
        tiny_gpt_argv(gpt_data, *ds, cfg[1], *tp2, *DROPOUT, *ckpt, "--partition-activations"),
        _rampup_argv(gpt_data),
        _rampup_argv(gpt_data, *ds, write_ds_config(str(tmp / "ds_ramp.json"), zero_optimization={"stage": 2},
                                                    train_micro_batch_size_per_gpu=1, train_batch_size=16)),
        tiny_gpt_argv(gpt_data, *ds, write_ds_config(str(tmp / "ds_bf16.json"), bf16={"enabled": True}), iters=4),
        tiny_gpt_argv(gpt_data, *ds, cfg[0]),
    ]
    results = run_distributed(_runs, 2, args=(runs,))
    out = []
    for res in results[1]:  # Megatron prints the log line on the last rank
        assert res["error"] is None, res["error"]
        curve = parse_losses(res["stdout"])
        curve["params_norm"] = [float(x) for x in PARAMS_NORM_RE.findall(res["stdout"])]
        curve["grad_norm"] = [float(x) for x in GRAD_NORM_RE.findall(res["stdout"])]
        out.append(curve)
    return out


def test_zero_stages_match_megatron_dp(curves: list[dict]) -> None:
    ref = curves[0]
    assert ref["train"][20] < ref["train"][1] - 0.2, "the tiny GPT should learn within 20 steps"
    for stage, curve in ((0, curves[11]), (1, curves[1]), (2, curves[2]), (3, curves[3])):
        _assert_close(curve, ref, f"ZeRO-{stage} vs Megatron DP=2")
        # The logged grad norm (before clipping) is Megatron's too (printed with 3 decimals).
        assert len(curve["grad_norm"]) == 20, f"ZeRO-{stage}: grad norm missing from the log line"
        assert all(abs(a - b) <= 1.5e-3 for a, b in zip(curve["grad_norm"], ref["grad_norm"])), f"ZeRO-{stage}"
    # --log-params-norm under ZeRO (ZeRO-3 gathers its partitioned parameters first) equals Megatron's.
    assert len(ref["params_norm"]) == 20
    for stage in (1, 3):
        assert len(curves[stage]["params_norm"]) == 20
        assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(curves[stage]["params_norm"], ref["params_norm"]))


def test_tp2_zero1_matches_dp(curves: list[dict]) -> None:
    # Megatron's TP=2 and DP=2 both equal the serial run (tests/training); TP=2 under DeepSpeed must too.
    _assert_close(curves[4], curves[0], "TP=2 x ZeRO-1 vs Megatron DP=2")


def test_deepspeed_activation_checkpointing_replays_dropout(curves: list[dict]) -> None:
    plain, recompute, partitioned = curves[5], curves[6], curves[7]
    assert any(abs(plain["train"][i] - curves[4]["train"][i]) > 1e-3 for i in plain["train"]), "dropout had no effect"
    _assert_close(recompute, plain, "DeepSpeed activation checkpointing vs no recomputation (dropout on)")
    _assert_close(partitioned, plain, "partitioned DeepSpeed activation checkpoints vs no recomputation")


def test_rampup_through_set_train_batch_size(curves: list[dict]) -> None:
    # The engine's gradient accumulation follows Megatron's ramp-up (1 → 8 micro-batches per DP rank).
    _assert_close(curves[9], curves[8], "ZeRO-2 with --rampup-batch-size vs Megatron DP=2 with it")


def test_bf16_from_config(curves: list[dict]) -> None:
    bf16, fp32 = curves[10]["train"], curves[1]["train"]
    assert sorted(bf16) == [1, 2, 3, 4]
    same_lr = (1, 2, 3)  # the LR schedules (4 vs 20 iterations) agree until the warm-up ends at step 2
    assert all(math.isclose(bf16[i], fp32[i], rel_tol=1e-3) for i in same_lr), (bf16, fp32)
    assert any(bf16[i] != fp32[i] for i in same_lr), "bf16 in the config should change the numerics"


def test_tp2_zero2_dp2_four_processes(curves: list[dict], gpt_data: dict, tmp_path: Path) -> None:
    # TP=2 x ZeRO-2 over DP=2 (4 processes): ZeRO partitions across the data-parallel group of each TP rank.
    cfg = write_ds_config(str(tmp_path / "ds_zero2.json"), zero_optimization={"stage": 2})
    argv = tiny_gpt_argv(gpt_data, "--deepspeed", "--deepspeed_config", cfg, "--tensor-model-parallel-size", "2")
    (res,) = run_distributed(_runs, 4, args=([argv],))[3]
    assert res["error"] is None, res["error"]
    _assert_close(parse_losses(res["stdout"]), curves[0], "TP=2 x ZeRO-2 (DP=2) vs Megatron DP=2")
