"""End to end (pretrain_gpt, fp32, CPU/gloo): the distributed optimizer, --overlap-grad-reduce and
--overlap-param-gather give the serial 20-step loss curve within 1e-5 relative (training and validation losses) for
TP=2 + SP + DP=2 + distopt, DP=2 + distopt with both overlaps (several buckets), plain DP=2 with the overlapped
bucketed all-reduce, and PP=2 x DP=2 + distopt with the overlapped reduce-scatter (tied embedding shared across
stages), and the interleaved schedule PP=4 (2 virtual chunks per stage) x DP=2 with distopt and both overlaps. Resume with the distributed
optimizer and both overlaps is exact; its checkpoint (distrib_optim.pt) reloads at another data-parallel size and
without the flag, and a regular checkpoint loads into it.

Every run, the serial one included, starts from the serial model's initial weights (tests/pipeline/_workers.py), has
4 layers and micro-batch 2 (global batch 8).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.pipeline._workers import run_pretrain_serial_init
from tests.training._workers import parse_losses, tiny_gpt_argv

REL = 1e-5
SHAPE = ["--num-layers", "4", "--micro-batch-size", "2"]
DISTOPT = ["--use-distributed-optimizer"]
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]


GRAD_NORM_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.]+) \|")


def _grad_norms(stdout: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in GRAD_NORM_RE.finditer(stdout)}


def _argv(gpt_data: dict, *extra: str) -> list[str]:
    return tiny_gpt_argv(gpt_data, *SHAPE, *extra)


def _run(world_size: int, argv: list[str]) -> list[dict]:
    results = run_distributed(run_pretrain_serial_init, world_size, args=(argv,))
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    return results


def _assert_close(curve: dict, ref: dict, what: str, iters=range(1, 21)) -> None:
    assert sorted(curve["train"]) == list(iters), f"{what}: iterations differ"
    for it in iters:
        assert math.isclose(curve["train"][it], ref["train"][it], rel_tol=REL), \
            f"{what}: iteration {it}: {curve['train'][it]} vs {ref['train'][it]}"
    ref_val = dict(ref["val"])
    assert curve["val"], f"{what}: no validation losses"
    for point, loss in curve["val"]:
        assert math.isclose(loss, ref_val[point], rel_tol=REL), f"{what}: validation at {point}"


@pytest.fixture(scope="module")
def serial(gpt_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Serial reference (regular optimizer); saves a checkpoint at iteration 10 for the conversion test."""
    ckpt = tmp_path_factory.mktemp("serial") / "ckpt"
    (res,) = _run(1, _argv(gpt_data, "--save", str(ckpt), "--save-interval", "10"))
    curve = parse_losses(res["stdout"])
    assert curve["train"][20] < curve["train"][1] - 0.2, "the tiny GPT should learn within 20 steps"
    norms = _grad_norms(res["stdout"])
    assert len(norms) == 20 and max(norms.values()) > 1.0, "--clip-grad 1.0 should be active in some steps"
    return {"curve": curve, "ckpt": ckpt, "grad_norm": norms}


@pytest.fixture(scope="module")
def dp2_overlapped(gpt_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DP=2 + distributed optimizer + both overlaps (small buckets); saves at 10 and 20."""
    ckpt = tmp_path_factory.mktemp("dp2") / "ckpt"
    results = _run(2, _argv(gpt_data, *DISTOPT, *OVERLAP, "--overlap-param-gather", "--save", str(ckpt),
                            "--save-interval", "10"))
    return {"curve": parse_losses(results[-1]["stdout"]), "ckpt": ckpt, "stdout": results[-1]["stdout"]}


def test_dp2_distopt_overlap_matches_serial(dp2_overlapped: dict, serial: dict) -> None:
    _assert_close(dp2_overlapped["curve"], serial["curve"], "DP=2 + distopt + overlap")
    folder = dp2_overlapped["ckpt"] / "iter_0000010" / "mp_rank_00"
    assert sorted(p.name for p in folder.iterdir()) == ["distrib_optim.pt", "model_optim_rng.pt"]
    common = torch.load(folder / "model_optim_rng.pt", weights_only=False)["optimizer"]
    assert common["distributed_optimizer"] and common["optimizer"]["state"] == {}  # no sharded state in here
    full = torch.load(folder / "distrib_optim.pt", weights_only=False)
    emb = full["chunks"][0]["language_model.embedding.word_embeddings.weight"]
    assert emb["param"].shape == (5120, 64) and set(emb) == {"param", "exp_avg", "exp_avg_sq"}
    assert full["saved_data_parallel_size"] == 2 and full["step"] == 10


@pytest.mark.parametrize("layout", [
    pytest.param((4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", *DISTOPT]), id="tp2-sp-dp2-distopt"),
    pytest.param((2, OVERLAP), id="dp2-overlap-grad-reduce"),
    pytest.param((4, ["--pipeline-model-parallel-size", "2", *DISTOPT, *OVERLAP]), id="pp2-dp2-distopt-overlap"),
])
def test_layout_matches_serial(layout, serial: dict, gpt_data: dict) -> None:
    world_size, extra = layout
    results = _run(world_size, _argv(gpt_data, *extra))
    _assert_close(parse_losses(results[-1]["stdout"]), serial["curve"], f"{extra} vs serial")
    norms = _grad_norms(results[-1]["stdout"])  # printed with 3 decimals; computed over the shards
    assert sorted(norms) == sorted(serial["grad_norm"])
    for it, norm in serial["grad_norm"].items():
        assert math.isclose(norms[it], norm, rel_tol=2e-3, abs_tol=2e-3), f"{extra}: grad norm at {it}: {norms[it]} vs {norm}"


def test_resume_with_distopt_is_exact(dp2_overlapped: dict, gpt_data: dict, tmp_path: Path) -> None:
    """DP=2 + distopt + overlaps: 20 iterations == 10, save, resume, 10 more (identical printed losses)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "iter_0000010").symlink_to(dp2_overlapped["ckpt"] / "iter_0000010")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    resumed = _run(2, _argv(gpt_data, *DISTOPT, *OVERLAP, "--overlap-param-gather", "--load", str(ckpt)))
    ca, cb = dp2_overlapped["curve"], parse_losses(resumed[-1]["stdout"])
    assert sorted(cb["train"]) == list(range(11, 21))
    for it in range(11, 21):
        assert cb["train"][it] == ca["train"][it], (it, ca["train"][it], cb["train"][it])
    assert cb["val"] == ca["val"][1:]


def test_reload_at_other_dp_size_and_without_flag(dp2_overlapped: dict, serial: dict, gpt_data: dict,
                                                  tmp_path: Path) -> None:
    """The DP=2 distopt checkpoint at 10 continues at DP=1 with the regular optimizer (converted) like the DP=2 run;
    the serial regular checkpoint at 10 continues at DP=2 with the distributed optimizer (converted, sharded).
    (Resharding the saved state at DP=1 and DP=4 is also tested in tests/optimizer/test_distrib_optimizer.py.)"""
    ckpt = tmp_path / "dp2"
    ckpt.mkdir()
    (ckpt / "iter_0000010").symlink_to(dp2_overlapped["ckpt"] / "iter_0000010")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    (one,) = _run(1, _argv(gpt_data, "--load", str(ckpt)))
    assert "converting the checkpoint's --use-distributed-optimizer state" in one["stdout"]
    _assert_close(parse_losses(one["stdout"]), dp2_overlapped["curve"], "DP=2 distopt -> DP=1", range(11, 21))

    reg = tmp_path / "serial"
    reg.mkdir()
    (reg / "iter_0000010").symlink_to(serial["ckpt"] / "iter_0000010")
    (reg / "latest_checkpointed_iteration.txt").write_text("10")
    two = _run(2, _argv(gpt_data, *DISTOPT, "--load", str(reg)))
    assert "converting the regular optimizer state" in two[0]["stdout"]
    _assert_close(parse_losses(two[-1]["stdout"]), serial["curve"], "serial -> DP=2 distopt", range(11, 21))


def test_interleaved_pp4_dp2_distopt_overlap_matches_serial(gpt_data: dict) -> None:
    """Virtual pipeline chunks (PP=4, 2 chunks per stage) x DP=2 with the distributed optimizer and both overlaps
    (8 processes): every stage owns two DDP chunks whose buckets are reduce-scattered / all-gathered separately."""
    shape = ["--num-layers", "8", "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "10"]
    (ref,) = _run(1, tiny_gpt_argv(gpt_data, *shape))
    results = _run(8, tiny_gpt_argv(gpt_data, *shape, "--pipeline-model-parallel-size", "4",
                                    "--num-layers-per-virtual-pipeline-stage", "1", *DISTOPT, *OVERLAP,
                                    "--overlap-param-gather"))
    _assert_close(parse_losses(results[-1]["stdout"]), parse_losses(ref["stdout"]), "PP4(vp2) x DP2 + distopt",
                  iters=range(1, 11))
