"""pretrain() names every phase where a run can be silent for long to its heartbeat (megatron/progress.py): start-up
(process group, the dataset helpers' compilation), the model and checkpoint loading, the datasets' index files, the
first iteration, evaluations and checkpoint saves; the heartbeat thread runs only while pretrain() does."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.training._workers import tiny_gpt_argv


def _phases(rank: int, world_size: int, argv: list[str]) -> tuple[list[str], bool, bool]:
    """The phases pretrain() started (in order), and whether the heartbeat thread ran during and after it."""
    import megatron.training as training
    from tests.ds._workers import _reset_megatron
    from tests.harness import pretrain_run

    beat, seen, running = training.HEARTBEAT, [], []
    original = beat.doing

    def record(what: str, note: str = "", new_phase: bool = True) -> None:
        if new_phase:
            seen.append(what)
            running.append(beat.started())
        original(what, note, new_phase)

    beat.doing = record
    try:
        pretrain_run(argv)
    finally:
        _reset_megatron()
        del beat.doing
    return seen, any(running), beat.started()


@pytest.mark.slow
def test_pretrain_names_each_long_phase_to_the_heartbeat(gpt_data: dict, tmp_path: Path) -> None:
    from tests.dist_utils import run_distributed

    argv = tiny_gpt_argv(gpt_data, "--save", str(tmp_path / "ckpt"), "--save-interval", "2", "--eval-interval", "2",
                         "--lr-warmup-iters", "0", iters=2)
    ((seen, ran, after),) = run_distributed(_phases, 1, args=(argv,))
    starts = [s for s in seen if not s.startswith("iteration")]
    assert starts[:5] == [
        "starting up (the process group, compiling the dataset index helpers)",
        "building the model and optimizer (and loading the checkpoint, with --load)",
        "building the datasets (and their index files, on a first run)",
        "the first iteration of this run (1 of 2)",
        "evaluation at iteration 2",
    ], seen
    assert "saving the checkpoint of iteration 2" in starts and ran and not after
