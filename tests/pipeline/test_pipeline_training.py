"""Pipeline parallelism end to end on CPU (gloo, fp32): 20-step loss curves of every pipelined layout equal the
serial run's within 1e-5 relative (training and validation losses), checkpoint layout with per-stage folders and
virtual chunks, exact resume for TP=2 x PP=2, and the start-up error of the interleaved schedule.

All runs use 8 layers and micro-batch 1 (8 micro-batches per global batch of 8) and start from the serial model's
initial weights (see tests/pipeline/_workers.py).
"""
from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.pipeline._workers import run_pretrain_serial_init
from tests.training._workers import parse_losses, tiny_gpt_argv

REL = 1e-5
GRAD_NORM_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.]+) \|")
SHAPE = ["--num-layers", "8", "--micro-batch-size", "1"]


def _argv(gpt_data: dict, *extra: str, iters: int = 20) -> list[str]:
    return tiny_gpt_argv(gpt_data, *SHAPE, *extra, iters=iters)


def _run(world_size: int, argv: list[str]) -> list[dict]:
    results = run_distributed(run_pretrain_serial_init, world_size, args=(argv,))
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    return results


def _assert_close(curve: dict, ref: dict, what: str) -> None:
    assert sorted(curve["train"]) == sorted(ref["train"]) and len(ref["train"]) == 20, f"{what}: iterations differ"
    for it, loss in ref["train"].items():
        assert math.isclose(curve["train"][it], loss, rel_tol=REL), f"{what}: iteration {it}: {curve['train'][it]} vs {loss}"
    assert [p for p, _ in curve["val"]] == [p for p, _ in ref["val"]] and ref["val"], f"{what}: validation differs"
    for (p, a), (_, b) in zip(curve["val"], ref["val"]):
        assert math.isclose(a, b, rel_tol=REL), f"{what}: validation at {p}: {a} vs {b}"


@pytest.fixture(scope="module")
def serial(gpt_data: dict) -> dict:
    (res,) = _run(1, _argv(gpt_data))
    curve = parse_losses(res["stdout"])
    losses = [curve["train"][i] for i in range(1, 21)]
    assert losses[-1] < losses[0] - 0.2, "the tiny GPT should learn within 20 steps"
    curve["grad_norm"] = _grad_norms(res["stdout"])
    assert max(curve["grad_norm"].values()) > 1.0, "--clip-grad 1.0 should be active in some steps"
    return curve


def _grad_norms(stdout: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in GRAD_NORM_RE.finditer(stdout)}


LAYOUTS = {
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp4": (4, ["--pipeline-model-parallel-size", "4"]),
    "pp2-dp2": (4, ["--pipeline-model-parallel-size", "2", "--DDP-impl", "local"]),
    "pp2-dp2-torch-ddp": (4, ["--pipeline-model-parallel-size", "2", "--DDP-impl", "torch"]),
    "tp2-pp2-sp-recompute": (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                 "--sequence-parallel", "--recompute-activations"]),
}


@pytest.fixture(scope="module")
def layout_runs(gpt_data: dict) -> dict:
    """Every layout of LAYOUTS run once: one launch per world size, the runs one after another in one process group
    (tests/training/_llama.run_many), each starting from the serial model's initial weights."""
    from tests.training._llama import run_many

    out = {}
    for world_size in sorted({w for w, _ in LAYOUTS.values()}):
        names = [name for name, (w, _) in LAYOUTS.items() if w == world_size]
        results = run_distributed(run_many, world_size, args=([("stage", _argv(gpt_data, *LAYOUTS[n][1]))
                                                               for n in names],))
        for i, name in enumerate(names):
            out[name] = [per_rank[i] for per_rank in results]
            assert all(r["error"] is None for r in out[name]), (name, [r["error"] for r in out[name]])
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipelined_layout_matches_serial(name: str, serial: dict, layout_runs: dict) -> None:
    extra = LAYOUTS[name][1]
    results = layout_runs[name]
    # Megatron prints the log line on the last rank (last pipeline stage); other ranks print no loss.
    _assert_close(parse_losses(results[-1]["stdout"]), serial, f"{extra} vs serial")
    assert parse_losses(results[0]["stdout"])["train"] == {}
    # The global grad norm (clipping at 1.0) is one number over all stages: it must equal the serial one.
    norms = _grad_norms(results[-1]["stdout"])
    assert sorted(norms) == sorted(serial["grad_norm"])
    for it, norm in serial["grad_norm"].items():
        assert math.isclose(norms[it], norm, rel_tol=2e-3, abs_tol=2e-3), f"{extra}: grad norm at {it}"


def test_interleaved_matches_serial_and_saves_chunks(serial: dict, gpt_data: dict, tmp_path: Path) -> None:
    """PP=4 with 2 virtual chunks of 1 layer per rank; checkpoint files hold model0/model1."""
    extra = ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
             "--save", str(tmp_path / "ckpt"), "--save-interval", "20"]
    results = _run(4, _argv(gpt_data, *extra))
    _assert_close(parse_losses(results[-1]["stdout"]), serial, "interleaved PP=4 vs serial")
    it_dir = tmp_path / "ckpt" / "iter_0000020"
    assert sorted(os.listdir(it_dir)) == ["manifest.json", *(f"mp_rank_00_{pp:03d}" for pp in range(4))]
    sd = torch.load(it_dir / "mp_rank_00_003" / "model_optim_rng.pt", weights_only=False)
    assert "model" not in sd and {"model0", "model1"} <= set(sd)
    # rank 3 holds global layers 4 (chunk 0) and 8 (chunk 1, with the final LayerNorm and the head's embedding)
    assert "word_embeddings_for_head" in sd["model1"] and "word_embeddings_for_head" not in sd["model0"]
    assert "final_layernorm.weight" in sd["model1"]["language_model"]["encoder"]
    first = torch.load(it_dir / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)
    emb = first["model0"]["language_model"]["embedding"]["word_embeddings"]["weight"]
    assert torch.equal(emb, sd["model1"]["word_embeddings_for_head"]["weight"])  # tied copies stayed in sync


def test_tp2_pp2_matches_serial_and_resumes_exactly(serial: dict, gpt_data: dict, tmp_path: Path) -> None:
    extra = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    full = _run(4, _argv(gpt_data, *extra, "--save", str(tmp_path / "a"), "--save-interval", "10"))
    curve = parse_losses(full[-1]["stdout"])
    _assert_close(curve, serial, "TP=2 x PP=2 vs serial")
    assert sorted(os.listdir(tmp_path / "a" / "iter_0000010")) == ["manifest.json", "mp_rank_00_000", "mp_rank_00_001",
                                                                 "mp_rank_01_000", "mp_rank_01_001"]
    # Pretend the run stopped after iteration 10 and resume from there.
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text("10")
    resumed = _run(4, _argv(gpt_data, *extra, "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"),
                            "--save-interval", "10"))
    again = parse_losses(resumed[-1]["stdout"])
    assert sorted(again["train"]) == list(range(11, 21))
    for it in range(11, 21):  # identical to the last printed digit
        assert again["train"][it] == curve["train"][it], (it, curve["train"][it], again["train"][it])
    assert again["val"] == curve["val"][1:]


def test_interleaving_needs_microbatches_divisible_by_pp() -> None:
    from megatron.errors import MegatronUserError
    from megatron.run_configs.step import StepSettings
    from megatron.training import check_pipeline_schedule

    step = StepSettings.from_args(argparse.Namespace(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2))
    check_pipeline_schedule(step, 8)
    with pytest.raises(MegatronUserError, match=r"micro-batches \(6 = .*divisible by --pipeline-model-parallel-size"):
        check_pipeline_schedule(step, 6)
    check_pipeline_schedule(StepSettings.from_args(argparse.Namespace(pipeline_model_parallel_size=4)), 6)
