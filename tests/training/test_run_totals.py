"""The run's skipped and non-finite iteration totals (TrainingState) survive an exact resume.

One process, two pretrain() runs through tests/harness.py (no entry script patched): the tiny GPT for 6 iterations
whose forward step returns a nan loss at iteration 2 (skipped and counted: 1 skipped, 1 nan), saving at 4 and 6; then
a run resumed from its iteration-4 checkpoint to 6; then the same pair through --ckpt-format torch_dist (stopping at 4).
The checkpoint holds the totals under our two top-level keys, and each resumed run ends with the same totals and the
same losses as the uninterrupted one.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training._workers import checkpoint_at, tiny_gpt_argv

NAN_AT_CALL = 3  # 2 micro-batches per iteration: the first forward step of iteration 2


def _runs(rank: int, world_size: int, runs: list[tuple[list[str], bool]]) -> list[dict]:
    """pretrain() runs one after another; with True, the forward step makes iteration 2's loss nan."""
    from tests.ds._workers import _reset_megatron
    from tests.harness import entry_providers, pretrain_run

    original = entry_providers("pretrain_gpt").forward_step

    def nan_once(calls: dict):
        def forward_step(data_iterator, model):
            calls["n"] += 1
            output, loss_func = original(data_iterator, model)
            return (output * float("nan") if calls["n"] == NAN_AT_CALL else output), loss_func
        return forward_step

    out = []
    for run_argv, inject in runs:
        try:
            out.append(pretrain_run(run_argv, forward_step=nan_once({"n": 0}) if inject else None))
        finally:
            _reset_megatron()
    return out


@pytest.mark.slow
def test_skipped_and_nan_totals_are_saved_and_continue_on_exact_resume(gpt_data: dict, tmp_path: Path) -> None:
    from tests.dist_utils import run_distributed

    ckpt, dist = tmp_path / "ckpt", tmp_path / "dist"
    argv = tiny_gpt_argv(gpt_data, "--save", str(ckpt), "--save-interval", "2", iters=6)
    resume = tiny_gpt_argv(gpt_data, "--load", str(checkpoint_at(ckpt, 4, tmp_path)), iters=6)
    td = ("--ckpt-format", "torch_dist")
    dist_argv = tiny_gpt_argv(gpt_data, "--save", str(dist), "--save-interval", "2", "--exit-interval", "4", *td,
                              iters=6)
    runs = [(argv, True), (resume, False), (dist_argv, True),
            (tiny_gpt_argv(gpt_data, "--load", str(dist), *td, iters=6), False)]
    ((full, resumed, _, dist_resumed),) = run_distributed(_runs, 1, args=(runs,))

    assert (full["skipped_iterations"], full["nan_iterations"]) == (1, 1)
    assert all(torch.isfinite(torch.tensor(v["lm loss"])) == (it != 2) for it, v in full["train_losses"].items())
    saved = torch.load(ckpt / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert (saved["skipped_iterations"], saved["nan_iterations"]) == (1, 1)
    assert "skipped_iterations" not in vars(saved["args"])  # Megatron's args namespace is unchanged

    assert sorted(resumed["train_losses"]) == [5, 6]
    assert (resumed["skipped_iterations"], resumed["nan_iterations"]) == (1, 1)
    assert resumed["train_losses"] == {it: full["train_losses"][it] for it in (5, 6)}
    # the same through a torch_dist checkpoint (its common state carries the totals)
    assert (dist_resumed["skipped_iterations"], dist_resumed["nan_iterations"]) == (1, 1)
    assert dist_resumed["train_losses"] == resumed["train_losses"]
