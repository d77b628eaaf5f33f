"""--optimizer muon (--muon-tp-mode duplicated, fp32 Newton-Schulz) on the tiny Llama of tests/training/_llama.py:
TP=2 + SP, PP=2, DP=2 and DP=2 with --optimizer dist_muon (layer-wise distributed) train the serial run's 20-step
curve (losses within 1e-5 relative). Checkpoints at iteration 10 continue the serial curve: the dist_muon DP=2 one
(legacy format, Muon momentum and Adam moments in it) at DP=2 with --use-checkpoint-args, at DP=1 with muon, and,
reshaped by convert.py, at TP=2 (muon, and dist_muon with --use-checkpoint-args); the muon DP=2 one in torch_dist
(Megatron Core's optimizer.state.momentum_buffer.* names) at TP=2 and DP=1. The Mixtral-style MoE of
tests/training/test_moe_training.py with its experts over EP=2 (dist_muon: the dense weights dealt over DP=2) trains
its serial Muon curve. Three jobs (2, 2 and 1 processes) run the layouts one after another.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.conversion.driver import main
from megatron.checkpoint.conversion.torch_dist import read_tensors
from tests.dist_utils import run_distributed
from tests.training._llama import ITERS, assert_matches, curve_of, llama_argv, run_many
from tests.training._workers import checkpoint_at
from tests.training.test_moe_training import _argv as moe_argv
from tests.training.test_moe_training import _curve as moe_curve
from tests.training.test_moe_training import _same as moe_same

MUON = ["--optimizer", "muon", "--muon-tp-mode", "duplicated", "--muon-fp32-matmul-prec", "high",
        "--muon-use-nesterov", "--lr", "2e-2", "--min-lr", "2e-3"]
HALF = ITERS // 2


@pytest.fixture(scope="module")
def serial(gpt_data: dict) -> dict:
    ((res,),) = run_distributed(run_many, 1, args=([("stage", llama_argv(gpt_data, *MUON))],))
    curve = curve_of(res, "serial muon")
    assert curve["train"][ITERS] < curve["train"][1] - 0.1, "Muon should train the tiny Llama"
    return curve


def _resumed(curve: dict, serial: dict, what: str) -> None:
    assert sorted(curve["train"]) == list(range(HALF + 1, ITERS + 1)), what
    for it in range(HALF + 1, ITERS + 1):
        a, b = curve["train"][it], serial["train"][it]
        assert math.isclose(a, b, rel_tol=1e-5), f"{what}: iteration {it}: {a} vs serial {b}"


def test_muon_layouts_match_serial_and_dp2_checkpoint_resumes_anywhere(serial: dict, gpt_data: dict,
                                                                     tmp_path: Path) -> None:
    ckpt, ckpt_td = tmp_path / "dp2", tmp_path / "dp2_torch_dist"
    ckpt.mkdir()
    ckpt_td.mkdir()
    at_half = checkpoint_at(ckpt, HALF, tmp_path)  # a link to the DP=2 dist_muon run's save at HALF (4th run)
    td_at_half = checkpoint_at(ckpt_td, HALF, tmp_path)  # the DP=2 muon run's torch_dist save at HALF (3rd run)
    torch_dist = ["--ckpt-format", "torch_dist"]
    layouts = {
        "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "pp2": ["--pipeline-model-parallel-size", "2"],
        "dp2": [*torch_dist, "--save", str(ckpt_td), "--save-interval", str(HALF)],
        "dp2 dist_muon": ["--optimizer", "dist_muon", "--save", str(ckpt), "--save-interval", str(HALF)],
    }
    resumed = {"dp2 dist_muon -> dp2 --use-checkpoint-args": ["--optimizer", "dist_muon", "--use-checkpoint-args"]}
    runs = [("stage", llama_argv(gpt_data, *MUON, *extra)) for extra in layouts.values()]
    runs += [("stage", llama_argv(gpt_data, *MUON, *extra, "--load", str(at_half))) for extra in resumed.values()]
    runs.append(("stage", moe_argv(gpt_data, *MUON, "--optimizer", "dist_muon", "--expert-model-parallel-size", "2")))
    results = run_distributed(run_many, 2, args=(runs,))[-1]
    for i, name in enumerate(layouts):
        assert_matches(curve_of(results[i], name), serial, name)
    for j, name in enumerate(resumed, start=len(layouts)):
        _resumed(curve_of(results[j], name), serial, name)
    state = torch.load(ckpt / f"iter_{HALF:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    keys = {frozenset(s) for s in state["optimizer"]["state"].values()}
    assert keys == {frozenset({"momentum_buffer"}), frozenset({"exp_avg", "exp_avg_sq", "step"})}
    names = read_tensors(str(ckpt_td / f"iter_{HALF:07d}"), trust=True)
    assert "optimizer.state.momentum_buffer.decoder.layers.self_attention.linear_qkv.weight" in names  # Core's names
    assert "optimizer.state.exp_avg.embedding.word_embeddings.weight" in names
    assert not any(k.startswith("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight") for k in names)
    main(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir", str(at_half),
          "--save-dir", str(tmp_path / "tp2"), "--target-tensor-parallel-size", "2"])  # convert.py
    converted = torch.load(tmp_path / "tp2" / f"iter_{HALF:07d}" / "mp_rank_01" / "distrib_optim.pt", weights_only=False)
    assert {frozenset(e) - {"param"} for e in converted["chunks"][0].values()} == {
        frozenset({"momentum_buffer"}), frozenset({"exp_avg", "exp_avg_sq"})}
    tp2 = ["--tensor-model-parallel-size", "2", "--no-load-rng", "--load"]
    at_tp2 = {"dp2 dist_muon -> convert.py -> tp2": [*tp2, str(tmp_path / "tp2")],
              "dp2 dist_muon -> convert.py -> tp2 dist_muon --use-checkpoint-args": [
                  "--optimizer", "dist_muon", "--use-checkpoint-args", *tp2, str(tmp_path / "tp2")],
              "dp2 torch_dist -> tp2": [*torch_dist, *tp2, str(td_at_half)]}
    runs = [("stage", llama_argv(gpt_data, *MUON, *extra)) for extra in at_tp2.values()]
    for name, result in zip(at_tp2, run_distributed(run_many, 2, args=(runs,))[-1]):  # the last rank logs
        _resumed(curve_of(result, name), serial, name)
    (dp1, td_dp1, moe), = run_distributed(run_many, 1, args=([
        ("stage", llama_argv(gpt_data, *MUON, "--load", str(at_half))),
        ("stage", llama_argv(gpt_data, *MUON, *torch_dist, "--load", str(td_at_half))),
        ("stage", moe_argv(gpt_data, *MUON))],))
    _resumed(curve_of(dp1, "dp2 -> dp1"), serial, "dp2 -> dp1")
    _resumed(curve_of(td_dp1, "dp2 torch_dist -> dp1"), serial, "dp2 torch_dist -> dp1")
    moe_same(moe_curve(results[-1], "MoE EP2 dist_muon"), moe_curve(moe, "MoE serial"), "MoE EP2", z_loss=False)
