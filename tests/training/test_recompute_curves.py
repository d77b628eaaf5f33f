"""Activation recomputation and sequence parallelism end to end (pretrain_gpt, fp32, CPU/gloo).

* every recompute mode's 20-step curve (train and validation losses) equals the plain serial curve within 1e-5
  relative: selective, full uniform (1 layer), full block (1 and 2 layers), the old ``--checkpoint-activations
  --checkpoint-num-layers 1`` spelling, and TP=2 + SP with full recomputation;
* with dropout on, recomputation replays the same dropout masks (RNG state restored): same curve as no recompute;
* Megatron bug #1446: after 32 TP=2 + SP steps with weight decay and clipping, every replicated weight (the
  LayerNorms and row-parallel biases marked ``sequence_parallel``, and the position embeddings) is bitwise
  identical on both TP ranks.

(TP=2 x DP=2 + SP and TP=2 x PP=2 + SP + selective recomputation are in test_gpt_training.py and
tests/pipeline/test_pipeline_training.py; model-level recompute parity is in tests/model.)
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training._workers import parse_losses, run_pretrain, tiny_gpt_argv

REL = 1e-5
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
RECOMPUTE = {
    "selective": ["--recompute-activations"],
    "full-uniform-1": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                       "1"],
    "full-block-1": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
    "full-block-2": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
    "checkpoint-activations": ["--checkpoint-activations", "--checkpoint-num-layers", "1"],
}


def _curve(world_size: int, argv: list[str]) -> tuple[dict, list[dict]]:
    results = run_distributed(run_pretrain, world_size, args=(argv,))
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    curve = parse_losses(results[-1]["stdout"])  # the loss is printed by the last rank
    assert len(curve["train"]) == int(argv[argv.index("--train-iters") + 1]), results[-1]["stdout"][-2000:]
    return curve, results


def _assert_close(curve: dict, ref: dict, what: str) -> None:
    assert sorted(curve["train"]) == sorted(ref["train"]), what
    for it, loss in ref["train"].items():
        assert math.isclose(curve["train"][it], loss, rel_tol=REL), f"{what}: iteration {it}: {curve['train'][it]} vs {loss}"
    assert len(curve["val"]) == len(ref["val"]) > 0, what
    for (p, a), (_, b) in zip(curve["val"], ref["val"]):
        assert math.isclose(a, b, rel_tol=REL), f"{what}: validation at {p}: {a} vs {b}"


@pytest.fixture(scope="module")
def serial(gpt_data: dict) -> dict:
    return _curve(1, tiny_gpt_argv(gpt_data))[0]


@pytest.mark.parametrize("mode", list(RECOMPUTE))
def test_recompute_curve_equals_serial(mode: str, serial: dict, gpt_data: dict) -> None:
    curve, _ = _curve(1, tiny_gpt_argv(gpt_data, *RECOMPUTE[mode]))
    _assert_close(curve, serial, mode)


def test_tp2_sp_full_recompute_equals_serial(serial: dict, gpt_data: dict) -> None:
    argv = tiny_gpt_argv(gpt_data, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                         *RECOMPUTE["full-uniform-1"])
    curve, results = _curve(2, argv)
    _assert_close(curve, serial, "TP=2 + SP + full recompute")
    # The start-up estimate's most-loaded shard is the parameter count the model build printed for TP rank 0.
    out = results[0]["stdout"]
    built = int(re.search(r"model parallel rank \(0, 0\): (\d+)", out).group(1))
    estimated = int(re.search(r"Number of parameters in most loaded shard in billions: \S+ \((\d+)\)", out).group(1))
    assert built == estimated
    assert "Theoretical memory footprints: weight and optimizer=" in out and "activation=" in out
    assert re.search(r"^\[Rank 0\] \(after 1 iterations\) memory \(MB\) \| allocated: ", out, re.M)
    assert re.search(r"^\[Rank 1\] \(after 1 iterations\) memory \(MB\) \| allocated: ", results[1]["stdout"], re.M)


@pytest.fixture(scope="module")
def dropout_reference(gpt_data: dict) -> dict:
    return _curve(1, tiny_gpt_argv(gpt_data, *DROPOUT, iters=10))[0]


@pytest.mark.parametrize("mode", ["selective", "full-uniform-1"])
def test_recompute_with_dropout_replays_masks(mode: str, dropout_reference: dict, serial: dict,
                                              gpt_data: dict) -> None:
    curve, _ = _curve(1, tiny_gpt_argv(gpt_data, *DROPOUT, *RECOMPUTE[mode], iters=10))
    _assert_close(curve, dropout_reference, f"{mode} with dropout")
    assert curve["train"][1] != serial["train"][1]  # dropout really changes the loss


def test_sequence_parallel_weights_stay_identical_across_tp(gpt_data: dict, tmp_path: Path) -> None:
    """Megatron bug #1446: sequence-parallel LayerNorm grads must be all-reduced over TP or the copies drift."""
    argv = tiny_gpt_argv(gpt_data, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--weight-decay",
                         "0.1", "--clip-grad", "0.5", "--lr", "3e-3", "--eval-iters", "0", "--save",
                         str(tmp_path / "ckpt"), "--save-interval", "32", iters=32)
    _curve(2, argv)
    shards = [torch.load(tmp_path / "ckpt" / "iter_0000032" / f"mp_rank_0{r}" / "model_optim_rng.pt",
                         weights_only=False)["model"]["language_model"] for r in (0, 1)]
    replicated = {}
    for part in ("embedding", "encoder"):
        for shard in shards:
            flat = shard[part] if part == "encoder" else {"position_embeddings.weight":
                                                           shard[part]["position_embeddings"]["weight"]}
            for name, tensor in flat.items():
                if "layernorm" in name or name.endswith(("dense.bias", "dense_4h_to_h.bias", "position_embeddings.weight")):
                    replicated.setdefault(name, []).append(tensor)
    # 2 layers x (2 LayerNorms x 2 + 2 row-parallel biases) + final LayerNorm (2) + position embeddings
    assert len(replicated) == 2 * 6 + 2 + 1, sorted(replicated)
    trained = replicated["final_layernorm.weight"][0]
    assert not torch.equal(trained, torch.ones_like(trained))  # the LayerNorm weights did train
    different = [name for name, (a, b) in replicated.items() if not torch.equal(a, b)]
    assert not different, different
