"""The reliability guards are collective: with tensor parallelism over 2 gloo processes, a bit flip in rank 1's file of
the latest checkpoint makes both ranks fall back to the previous iteration (one line, exact losses), and a non-finite
loss is skipped on both ranks and stops both with the same one-line error."""
from __future__ import annotations

import functools
from pathlib import Path

from tests.dist_utils import run_distributed
from tests.log_lines import iteration_lines, iteration_values
from tests.reliability._dist_workers import flip_a_bit, run_sequence
from tests.reliability.helpers import train_argv


def test_tp2_fallback_and_nan_stop_agree_on_both_ranks(tiny_data: dict, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    tp2 = ["--tensor-model-parallel-size", "2", "--distributed-backend", "gloo", "--save-interval", "2"]
    runs = [train_argv(tiny_data, *tp2, "--save", ckpt, "--exit-interval", "4", iters=6),
            train_argv(tiny_data, *tp2, "--load", ckpt, "--exit-interval", "4", iters=6),
            train_argv(tiny_data, *tp2, "--lr", "1e9", "--lr-warmup-iters", "0", "--max-skipped-iterations", "2",
                       iters=6)]
    damaged = str(tmp_path / "ckpt" / "iter_0000004" / "mp_rank_01" / "model_optim_rng.pt")
    results = run_distributed(run_sequence, 2, args=(runs, functools.partial(flip_a_bit, damaged, 0)))
    first, resumed, nan = ([results[rank][i] for rank in (0, 1)] for i in range(3))
    assert first[0]["error"] is None and first[1]["error"] is None
    assert resumed[0]["error"] is None and resumed[1]["error"] is None, resumed[0]["error"]
    skipped = [line for line in resumed[0]["stdout"].splitlines() if "skipped damaged checkpoint" in line]
    assert len(skipped) == 1 and "iteration(s) 4 (mp_rank_01/model_optim_rng.pt has checksum" in skipped[0]
    assert "loading iteration 2" in skipped[0]
    original = iteration_values(first[1]["stdout"], as_text=True)
    again = iteration_values(resumed[1]["stdout"], as_text=True)
    assert sorted(again) == [3, 4] and all(again[i] == original[i] for i in again)
    for rank in (0, 1):
        assert nan[rank]["error"] is not None and "stopped at iteration 3: 2 consecutive" in nan[rank]["error"]
    assert [loss for _, loss in iteration_lines(nan[1]["stdout"], as_text=True)][1:] == ["nan", "nan"]
