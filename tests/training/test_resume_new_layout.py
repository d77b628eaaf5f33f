"""Resume training on another layout (issue 15 section 2): a training checkpoint with its optimizer state, converted
by tools/checkpoint/convert.py to another TP x PP x DP layout, continues the run under --load exactly like the
original layout continuing: training and validation losses of iterations 11-20 within 1e-5 relative, the same
consumed samples and learning rates per iteration (pretrain_gpt, fp32, gloo CPU, the tiny GPT of
tests/training/_workers.py: 5,000-token vocabulary padded to 5,120 rows at TP 1 and 2).

- TP2 x PP2 x DP1, regular optimizer -> TP1 x PP1 x DP2 (resumed with the distributed optimizer);
- TP1 x DP2, distributed optimizer -> TP2 x PP2 (resumed with the regular optimizer; tied embedding on 2 stages);
- DeepSpeed ZeRO-1 x DP2 (pretrain_gpt --deepspeed, --loader deepspeed) -> Megatron TP2 without DeepSpeed.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training._workers import checkpoint_at as _at
from tests.training._workers import parse_losses, run_pretrain, tiny_gpt_argv

REL = 1e-5
SHAPE = ["--num-layers", "4", "--micro-batch-size", "2"]
STEP_RE = re.compile(r" iteration +(\d+)/ *\d+ \| consumed samples: +(\d+) \|.*? learning rate: ([0-9.E+-]+) \|")


def _run(world_size: int, argv: list[str]) -> str:
    """Rank 0's and the last rank's output (the last rank is on the last pipeline stage: it prints the losses)."""
    results = run_distributed(run_pretrain, world_size, args=(argv,))
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    return results[0]["stdout"] + results[-1]["stdout"] if world_size > 1 else results[0]["stdout"]


def _steps(stdout: str) -> dict:
    return {int(m.group(1)): (int(m.group(2)), m.group(3)) for m in STEP_RE.finditer(stdout)}


def _convert(src: Path, dst: Path, *extra: str) -> dict:
    from megatron.checkpoint.conversion.driver import main

    return main(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir", str(src),
                 "--save-dir", str(dst), *extra])


def _assert_continues(resumed: str, original: str, first: int, what: str) -> None:
    """Iterations first..20 of `resumed` equal `original`'s: losses (1e-5), consumed samples, learning rates."""
    ca, cb = parse_losses(original), parse_losses(resumed)
    assert sorted(cb["train"]) == list(range(first, 21)), what
    for it in range(first, 21):
        assert math.isclose(cb["train"][it], ca["train"][it], rel_tol=REL), \
            f"{what}: iteration {it}: {cb['train'][it]} vs {ca['train'][it]}"
    ref_val = dict(ca["val"])
    assert cb["val"] and all(math.isclose(loss, ref_val[p], rel_tol=REL) for p, loss in cb["val"]), what
    sa, sb = _steps(original), _steps(resumed)
    assert sorted(sb) == list(range(first, 21)) and all(sb[it] == sa[it] for it in sb), \
        f"{what}: consumed samples / learning rate differ"
    assert sb[first][0] == 8 * first  # (first - 1) iterations x global batch 8 consumed before, carried over


def test_resume_on_new_layouts(gpt_data: dict, tmp_path: Path) -> None:
    """A: TP2 x PP2 x DP1 (regular optimizer), 20 iterations, saved at 10. B: A's iteration 10 converted to TP1,
    resumed at DP2 with the distributed optimizer, saved at 15. C: B's iteration 15 converted to TP2 x PP2, resumed
    with the regular optimizer. B continues A, C continues B (and A)."""
    a_ckpt, b_ckpt = tmp_path / "a", tmp_path / "b"
    a = _run(4, tiny_gpt_argv(gpt_data, *SHAPE, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                              "2", "--save", str(a_ckpt), "--save-interval", "10"))
    summary = _convert(_at(a_ckpt, 10, tmp_path), tmp_path / "tp1", "--target-tensor-parallel-size", "1",
                       "--target-pipeline-parallel-size", "1")
    assert summary["meta"].extra["optimizer"]["step"] == 10
    folder = tmp_path / "tp1" / "iter_0000010" / "mp_rank_00"
    assert sorted(p.name for p in folder.iterdir()) == ["distrib_optim.pt", "model_optim_rng.pt"]
    state = torch.load(folder / "distrib_optim.pt", weights_only=False)
    emb = state["chunks"][0]["language_model.embedding.word_embeddings.weight"]
    assert emb["exp_avg"].shape == (5120, 64) and emb["exp_avg_sq"][5000:].abs().sum() > 0  # padding rows trained

    b = _run(2, tiny_gpt_argv(gpt_data, *SHAPE, "--use-distributed-optimizer", "--load", str(tmp_path / "tp1"),
                              "--no-load-rng", "--save", str(b_ckpt), "--save-interval", "5"))
    _assert_continues(b, a, 11, "TP2xPP2 regular -> TP1xDP2 distopt")

    _convert(_at(b_ckpt, 15, tmp_path), tmp_path / "tp2pp2", "--target-tensor-parallel-size", "2",
             "--target-pipeline-parallel-size", "2")
    c = _run(4, tiny_gpt_argv(gpt_data, *SHAPE, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                              "2", "--load", str(tmp_path / "tp2pp2"), "--no-load-rng"))
    assert "converting the checkpoint's --use-distributed-optimizer state for the regular optimizer" in c
    _assert_continues(c, b, 16, "TP1xDP2 distopt -> TP2xPP2 regular")


def test_deepspeed_zero1_to_megatron_tp2(gpt_data: dict, tmp_path: Path) -> None:
    """pretrain_gpt --deepspeed with ZeRO-1 over DP=2 saves global_step10 (flat fp32 and Adam partitions per DP
    rank); converted with --loader deepspeed to Megatron TP2, pretrain_gpt without DeepSpeed continues its curve."""
    from tests.ds._workers import run_pretrain_ds, write_ds_config

    cfg = write_ds_config(str(tmp_path / "ds.json"), train_micro_batch_size_per_gpu=2, train_batch_size=8)
    results = run_distributed(run_pretrain_ds, 2, args=(tiny_gpt_argv(
        gpt_data, *SHAPE, "--deepspeed", "--deepspeed_config", cfg, "--save", str(tmp_path / "ds"),
        "--save-interval", "10"),))
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    original = results[-1]["stdout"]
    assert sorted(p.name for p in (tmp_path / "ds" / "global_step10").glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    summary = _convert(tmp_path / "ds", tmp_path / "tp2", "--loader", "deepspeed", "--iteration", "10",
                       "--target-tensor-parallel-size", "2")
    assert summary["meta"].extra["optimizer"]["step"] == 10
    resumed = _run(2, tiny_gpt_argv(gpt_data, *SHAPE, "--tensor-model-parallel-size", "2", "--load",
                                    str(tmp_path / "tp2"), "--no-load-rng"))
    _assert_continues(resumed, original, 11, "DeepSpeed ZeRO-1 DP2 -> Megatron TP2")

    from megatron.checkpoint.conversion.interchange import ConversionError

    (tmp_path / "ds" / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    # A signed folder fails its manifest check first; an unsigned one the loader's own rank-file check: both one line
    with pytest.raises(ConversionError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt is missing|"
                                              r"missing rank file .*zero_pp_rank_1_mp_rank_00_optim_states\.pt"):
        _convert(tmp_path / "ds", tmp_path / "bad", "--loader", "deepspeed", "--iteration", "10")
    assert not (tmp_path / "bad").exists()
