"""Non-finite training is caught in every precision: with --lr 1e9 the loss turns nan at iteration 2; each such step
is skipped and counted (`lm loss: nan`, `grad norm: nan`, `number of nan iterations`), the run stops with one line
and exit code 1 after --max-skipped-iterations consecutive ones, and no checkpoint with non-finite weights is written
(the tracker never moves to one; nor is anything saved during the streak). Validation prints nan, not a made-up PPL. fp16's dynamic loss scaler still skips
its normal overflows without tripping the limit."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.safe_load import safe_torch_load
from megatron.nan_guard import NonFiniteTrainingError, SkipCounter
from tests.reliability.helpers import assert_one_line_error, run, train_argv

LINE_RE = re.compile(r" iteration +(\d+)/ *\d+ \|.*")
BLOWUP = ["--lr", "1e9", "--lr-warmup-iters", "0", "--max-skipped-iterations", "3"]


def _lines(stdout: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(0) for m in LINE_RE.finditer(stdout)}


def _weights_finite(path: Path) -> bool:
    sd = safe_torch_load(path)

    def walk(x) -> bool:
        if isinstance(x, torch.Tensor):
            return bool(torch.isfinite(x.float()).all())
        if isinstance(x, dict):
            return all(walk(v) for v in x.values())
        return True

    return walk(sd["model"])


@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16", "--initial-loss-scale", "16"]],
                         ids=["fp32", "bf16", "fp16"])
def test_nan_is_skipped_counted_and_stops(tiny_data: dict, tmp_path: Path, precision: list) -> None:
    save = ["--save", "ckpt", "--save-interval", "1"] if not precision or precision[0] != "--fp16" else []
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, *precision, *BLOWUP, *save, iters=20), cwd=tmp_path)
    assert_one_line_error(proc, "stopped at iteration 4", "3 consecutive iterations", "--max-skipped-iterations 3")
    lines = _lines(proc.stdout)
    assert sorted(lines) == [1, 2, 3, 4]
    assert "number of nan iterations:   0" in lines[1] and "lm loss: nan" not in lines[1]
    for it in (2, 3, 4):
        assert "lm loss: nan |" in lines[it] and "grad norm: nan |" in lines[it], lines[it]
        assert "number of skipped iterations:   1 |" in lines[it] and "number of nan iterations:   1 |" in lines[it]
    if save:  # iterations 2 and 3 are in the non-finite streak: not saved (test_divergence.py)
        ckpt = tmp_path / "ckpt"
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        saved = sorted(ckpt.glob("iter_*/mp_rank_00/model_optim_rng.pt"))
        assert [p.parts[-3] for p in saved] == ["iter_0000001"]
        assert all(_weights_finite(p) for p in saved)


def test_fp16_nonfinite_weights_are_never_saved(tiny_data: dict, tmp_path: Path) -> None:
    """fp16 weights overflow to inf after one step at lr 1e9: the save refuses (one line) and writes nothing."""
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, "--fp16", "--initial-loss-scale", "16", *BLOWUP, "--save",
                                              "ckpt", "--save-interval", "1", iters=5), cwd=tmp_path)
    assert_one_line_error(proc, "refusing to save the checkpoint of iteration 1", "not finite")
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()
    assert not list((tmp_path / "ckpt").glob("iter_*/*/*.pt"))


def test_fp16_overflow_backoff_does_not_trip_the_limit(tiny_data: dict, tmp_path: Path) -> None:
    """The dynamic scaler starts at 2^32 and skips while backing off: more skips than the limit, still exit 0."""
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, "--fp16", "--max-skipped-iterations", "3", iters=8),
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _lines(proc.stdout)
    assert sum("number of skipped iterations:   1 |" in line for line in lines.values()) >= 4


def test_validation_reports_nan(tiny_data: dict, tmp_path: Path) -> None:
    argv = train_argv(tiny_data, "--lr", "1e9", "--lr-warmup-iters", "0", "--max-skipped-iterations", "0",
                      "--split", "90,10,0", "--eval-interval", "3", "--eval-iters", "1", iters=3)
    proc = run("pretrain_gpt.py", *argv, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    val = [line for line in proc.stdout.splitlines() if "validation loss at iteration 3" in line]
    assert val and "lm loss value: nan | lm loss PPL: nan |" in val[0], val


def test_skip_counter_rules() -> None:
    counter = SkipCounter(3)
    for it in range(1, 40):  # fp16 overflow skips above the floor never count
        counter.update(it, skipped=True, nonfinite=False, loss_scale=2.0 ** (40 - it), min_loss_scale=1.0)
    counter.update(40, skipped=True, nonfinite=True, loss_scale=4.0, min_loss_scale=1.0)
    counter.update(41, skipped=False, nonfinite=False, loss_scale=4.0, min_loss_scale=1.0)  # resets
    counter.update(42, skipped=True, nonfinite=False, loss_scale=1.0, min_loss_scale=1.0)  # at the floor: counts
    counter.update(43, skipped=True, nonfinite=True, loss_scale=1.0, min_loss_scale=1.0)
    with pytest.raises(NonFiniteTrainingError, match="stopped at iteration 44: 3 consecutive"):
        counter.update(44, skipped=True, nonfinite=True, loss_scale=None, min_loss_scale=None)
    unlimited = SkipCounter(0)
    for it in range(100):
        unlimited.update(it, skipped=True, nonfinite=True, loss_scale=None, min_loss_scale=None)
    assert unlimited.consecutive == 100 and math.isfinite(unlimited.consecutive)
