"""Runs that diverge do not leave ruined checkpoints behind, and say where to resume (issue 30, must-fixes 4 and 5).

With --lr 1e9 the first step is finite and its update ruins the weights; the next losses are nan. No checkpoint is
written while the run is in such a non-finite streak, the stop line names the newest checkpoint written before the
streak (and says when that one holds the weights that gave the first non-finite loss); resuming a checkpoint whose
first step is non-finite says the checkpoint is damaged rather than "lower --lr"; a checkpoint holding non-finite
values is refused at load; and after loading an unverified checkpoint (no manifest.json) whose optimizer state is
damaged, the exploding loss stops the run with one line naming the checkpoint.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron.nan_guard import FirstLossWatch, NonFiniteTrainingError, SkipCounter
from tests.reliability.helpers import assert_one_line_error, run, train_argv

BLOWUP = ["--lr", "1e9", "--lr-warmup-iters", "0", "--max-skipped-iterations", "3", "--override-opt_param-scheduler"]
RESUME = ["--override-opt_param-scheduler"]  # these resumptions change --train-iters
STATE = Path("iter_0000004") / "mp_rank_00" / "model_optim_rng.pt"


@pytest.fixture(scope="module")
def good_run(tiny_data: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A healthy 4-iteration run with checkpoints at 2 and 4 (each records its last training loss)."""
    work = tmp_path_factory.mktemp("divergence")
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, "--save-interval", "2", iters=4), "--save", "ckpt", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work


def _copy(good_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(good_run / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit_optimizer_state(path: Path, edit) -> None:
    sd = torch.load(path, map_location="cpu", weights_only=False)
    optim = sd["optimizer"].get("optimizer", sd["optimizer"])  # fp16/bf16 wrap the torch optimizer's state
    for entry in optim["state"].values():
        edit(entry)
    torch.save(sd, path)


@pytest.mark.slow
def test_diverging_run_saves_nothing_in_the_streak_and_names_the_checkpoint_before_it(
        good_run: Path, tiny_data: dict, tmp_path: Path) -> None:
    ckpt = _copy(good_run, tmp_path)
    argv = train_argv(tiny_data, "--save-interval", "1", *BLOWUP, iters=20)
    proc = run("pretrain_gpt.py", *argv, "--load", "ckpt", "--save", "ckpt", cwd=tmp_path)
    line = assert_one_line_error(proc, "stopped at iteration 8", "since iteration 6", "nothing was saved during them")
    assert "the newest checkpoint before it, iteration 5 in ckpt, holds the weights that gave the first non-finite " \
           "loss" in line and "resume from iteration 4 in ckpt" in line, line
    assert "not saving the checkpoint of iteration 6: the run is in a non-finite streak since iteration 6" \
        in proc.stdout
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002", "iter_0000004", "iter_0000005"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    # iteration 5 holds finite but ruined weights: resuming it at a sane --lr says the checkpoint is the problem
    again = run("pretrain_gpt.py", *train_argv(tiny_data, "--max-skipped-iterations", "2",
                                               "--override-opt_param-scheduler", iters=20), "--load",
                "ckpt", cwd=tmp_path)
    line = assert_one_line_error(again, "stopped at iteration 7", "since iteration 6",
                                 "the checkpoint it started from (iteration 5 in ckpt)", "damaged, not the learning rate")
    assert "lower --lr" not in line


@pytest.mark.slow
def test_checkpoint_with_non_finite_values_is_refused_at_load(good_run: Path, tiny_data: dict,
                                                              tmp_path: Path) -> None:
    from megatron.checkpoint import integrity

    ckpt = _copy(good_run, tmp_path)
    _edit_optimizer_state(ckpt / STATE, lambda entry: entry["exp_avg"].view(-1)[0].fill_(float("inf")))
    integrity.write_manifest(str(ckpt / "iter_0000004"))  # signed as it is: the values themselves are the problem
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, *RESUME, iters=6), "--load", "ckpt", cwd=tmp_path)
    line = assert_one_line_error(proc, "the checkpoint loaded from --load", "iter_0000004", "non-finite optimizer state",
                                 "a lower --lr will not help")
    assert " iteration        5/" not in proc.stdout, line


@pytest.mark.slow
def test_unverified_checkpoint_with_damaged_bytes_stops_on_the_exploding_loss(good_run: Path, tiny_data: dict,
                                                                            tmp_path: Path) -> None:
    ckpt = _copy(good_run, tmp_path)
    for it in (2, 4):
        (ckpt / f"iter_{it:07d}" / "manifest.json").unlink()  # saved before manifests existed: loads unverified
    healthy = run("pretrain_gpt.py", *train_argv(tiny_data, *RESUME, iters=7), "--load", "ckpt", cwd=tmp_path)
    assert healthy.returncode == 0, healthy.stderr[-3000:]  # an intact unverified checkpoint trains on
    _edit_optimizer_state(ckpt / STATE, lambda entry: entry["exp_avg"].mul_(2e5))  # moments off by 2e5
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, *RESUME, iters=20), "--load", "ckpt", cwd=tmp_path)
    line = assert_one_line_error(proc, "exploded right after loading", "iter_0000004", "no manifest.json",
                                 "loaded unverified")
    assert "stopped at iteration 5:" in line or "stopped at iteration 6:" in line, line


def test_skip_counter_names_the_checkpoint_before_the_streak() -> None:
    counter = SkipCounter(2, loaded=(10, "iteration 10 in ck"))
    counter.update(11, skipped=False, nonfinite=False, loss_scale=None, min_loss_scale=None)
    counter.checkpoint(11, "ck")
    counter.update(12, skipped=False, nonfinite=False, loss_scale=None, min_loss_scale=None)
    counter.update(13, skipped=True, nonfinite=True, loss_scale=None, min_loss_scale=None)
    assert counter.in_streak and counter.streak_start == 13
    with pytest.raises(NonFiniteTrainingError, match="since iteration 13 .*the newest checkpoint before it is "
                                                     "iteration 11 in ck: resume from it with a lower --lr"):
        counter.update(14, skipped=True, nonfinite=True, loss_scale=None, min_loss_scale=None)
    fresh = SkipCounter(1)
    with pytest.raises(NonFiniteTrainingError, match="no checkpoint was written before it"):
        fresh.update(1, skipped=True, nonfinite=True, loss_scale=None, min_loss_scale=None)


def test_first_loss_watch_limits() -> None:
    watch = FirstLossWatch("ck/iter_0000004", first_iteration=5, recorded_loss=8.0, vocab_size=512)
    watch.check(5, {"lm loss": 9.5})  # a new batch can be worse than the recorded one
    with pytest.raises(NonFiniteTrainingError, match="the loss .617; the checkpoint recorded 8.* ck/iter_0000004"):
        watch.check(6, {"lm loss": 617.0})
    with pytest.raises(NonFiniteTrainingError, match="exploded"):
        watch.check(7, {"lm loss": float("nan")})
    watch.check(8, {"lm loss": float("nan")})  # only the first 3 iterations after the load are watched
    watch.check(6, {})  # a rank without the loss (not the last pipeline stage)
