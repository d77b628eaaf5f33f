"""--inprocess-restart (megatron/inprocess_restart.py): an exception on one rank at step 7 restarts every rank inside
its process from the latest checkpoint and the curve continues exactly. Two gloo ranks of the tiny GPT (DP2, saving
every 3 iterations): rank 1 raises in its 7th training forward step; rank 0, blocked in the gradient all-reduce with
it, fails at once ("Connection closed by peer": rank 1 closed its sockets, not a time-out) and restarts too; both
load iteration 6 and the losses of iterations 1-9 equal an uninterrupted run's. Also in one process."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron.arguments import ArgumentError, parse_args, validate_args
from tests.harness import entry_providers, pretrain_run
from tests.reliability.helpers import run_ranks, train_argv


@pytest.mark.slow
def test_exception_on_one_rank_restarts_all_and_the_curve_continues(tiny_data: dict, tmp_path: Path) -> None:
    def argv(ckpt: Path, *extra: str) -> list[str]:
        return train_argv(tiny_data, "--distributed-backend", "gloo", "--global-batch-size", "4", "--save",
                          str(ckpt), "--load", str(ckpt), "--save-interval", "3", *extra, iters=9)

    clean = run_ranks(argv(tmp_path / "clean_ckpt"), tmp_path / "clean")
    restarted = run_ranks(argv(tmp_path / "ckpt", "--inprocess-restart"), tmp_path / "restart",
                          REL_FAULT="1 train-forward 7 raise", MEGATRON_DISTRIBUTED_TIMEOUT_SECONDS="120")
    assert restarted[0]["train_losses"] == clean[0]["train_losses"]
    assert sorted(map(int, clean[0]["train_losses"])) == list(range(1, 10))
    logs = [(tmp_path / "restart" / f"rank{r}.out").read_text() for r in range(2)]
    assert "in-process restart 1: rank 1 of 2 failed during training iteration 7: RuntimeError: injected fault" \
        in logs[1]
    assert "in-process restart 1: rank 0 of 2 failed during training iteration 7: RuntimeError:" in logs[0]
    assert "Connection closed by peer" in logs[0].split("in-process restart 1:")[1].splitlines()[0]
    after = logs[0].split("in-process restart 1:")[1]  # the restarted attempt loaded the checkpoint of iteration 6
    assert "successfully loaded checkpoint from " in after and "ckpt at iteration 6\n" in after
    assert [r["iteration"] for r in restarted] == [9, 9] and "in-process restart 2" not in logs[0] + logs[1]


def _single_process_runs(rank: int, world_size: int, argvs: list[list[str]]) -> list:
    """In one process: a clean run, a run whose 5th forward step raises once with --inprocess-restart, and the same
    without the flag (the exception propagates: its message is returned)."""
    from tests.ds._workers import _reset_megatron

    gpt = entry_providers("pretrain_gpt")
    calls = {"n": 0}

    def failing_once(data_iterator, model):
        if model.training:
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("injected fault")
        return gpt.forward_step(data_iterator, model)

    out: list = []
    for i, argv in enumerate(argvs):
        calls["n"] = 0
        try:
            out.append(pretrain_run(argv, forward_step=failing_once if i else None))
        except RuntimeError as exc:
            out.append(str(exc))
        finally:
            _reset_megatron()
    return out


@pytest.mark.slow
def test_single_process_restart_continues_exactly(tiny_data: dict, tmp_path: Path) -> None:
    from tests.dist_utils import run_distributed

    def argv(ckpt: Path, *extra: str) -> list[str]:
        return train_argv(tiny_data, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2", *extra,
                          iters=6)

    ((clean, restarted, plain, with_async),) = run_distributed(
        _single_process_runs, 1, args=([argv(tmp_path / "a"), argv(tmp_path / "b", "--inprocess-restart"),
                                        argv(tmp_path / "c"),
                                        argv(tmp_path / "d", "--inprocess-restart", "--async-save")],))
    assert restarted["train_losses"] == clean["train_losses"] and restarted["iteration"] == 6
    # --async-save: a save in flight at the failure is abandoned (megatron/checkpoint/async_save.py abandon)
    assert with_async["train_losses"] == clean["train_losses"] and with_async["iteration"] == 6
    assert plain == "injected fault"  # without the flag the exception propagates


def test_monitor_flags_and_rank_granularity_are_refused() -> None:
    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--micro-batch-size", "1",
            "--seq-length", "8", "--max-position-embeddings", "8", "--train-iters", "1", "--lr", "1e-3"]
    for extra in (["--inprocess-soft-timeout", "30"], ["--inprocess-granularity", "rank"]):
        with pytest.raises(ArgumentError, match="nvidia-resiliency-ext"):
            validate_args(parse_args(args=[*base, *extra]))


def test_deepspeed_and_warm_reserve_are_refused_in_one_line() -> None:
    from megatron.inprocess_restart import InProcessRestart, InProcessRestartError
    from megatron.settings.values import Settings

    base = Settings.from_args(None).with_values(inprocess_restart=True)
    with pytest.raises(InProcessRestartError, match="--inprocess-restart with --deepspeed"):
        InProcessRestart().arm(base.with_values(deepspeed=True))
    with pytest.raises(InProcessRestartError, match="--inprocess-active-world-size 7: warm reserve"):
        InProcessRestart().arm(base.with_values(inprocess_active_world_size=7))
