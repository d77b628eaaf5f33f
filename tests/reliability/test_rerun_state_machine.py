"""Megatron-LM's rerun state machine (--rerun-mode, megatron/rerun_state_machine.py).

In-process: the state transitions of a step driven by hand (a transient error re-run in place on the same micro-batches
and RNG state; a persistent one saved, exit 16, re-run from the checkpoint's state, exit 17 and the tracker file's
lines in Megatron's format; a reproduced non-fatal spike continues; report_determinism_stats; Megatron's spiky rule),
and the one-line refusals. Through pretrain() (two spawned jobs: one serial process, then two gloo ranks running DP2
and PP2 one after the other): a step whose loss a test hook makes NaN once, and steps failed by
--error-injection-type transient_error, are re-run and the loss curve equals the clean run's exactly (fp32); a
persistent error saves and exits 16, the job resumed from that checkpoint re-runs the iteration and exits 17;
report_determinism_stats re-runs every step, reports and keeps the clean curve.
"""
from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from megatron import global_vars, training, training_state
from megatron.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunSettingsError,
    RerunState,
    RerunStateMachine,
    RerunTrackerError,
    iterations_to_skip_from_tracker,
    machine_for_run,
    refuse_outside_pretrain,
)
from megatron.settings.values import Settings

VALIDATE = RerunMode.VALIDATE_RESULTS
TRACKER_LINE = re.compile(r"ts=.+ node=.+ device=.+ jobID=(.+) rank=(.+) iteration=(.+) status=(.+) result=.+ "
                          r"message=.+")  # Megatron's parser of the tracker file


def _step(machine: RerunStateMachine, data: RerunDataIterator, corrupt: list, fatal: bool = True,
          rejection=torch.isnan) -> list:
    """One step of two micro-batches: each value (plus a random draw, which a re-run must repeat) is validated;
    `corrupt` holds the (run, micro-batch) pairs whose value becomes NaN (or x1000). Returns each run's values."""
    runs = []
    while machine.should_run_forward_backward(data):
        values = []
        for mb in range(2):
            value = torch.tensor(float(next(data))) + 0.01 * torch.rand(())
            if (len(runs), mb) in corrupt:
                value = value * (float("nan") if rejection is torch.isnan else 1000.0)
            machine.validate_result(value, rejection, "loss check", fatal=fatal)
            values.append(float(value))
        runs.append(values)
    machine.should_checkpoint_and_exit()
    return runs


def test_transient_error_is_rerun_in_place_on_the_same_batches_and_rng_then_continues() -> None:
    machine = RerunStateMachine(VALIDATE)
    data = RerunDataIterator(iter(range(100)))
    first = _step(machine, data, corrupt=[(0, 1)])  # the first step is never validated (as Megatron)
    assert len(first) == 1 and machine.diagnostics == []
    runs = _step(machine, data, corrupt=[(0, 1)])
    assert len(runs) == 2 and runs[1][0] == runs[0][0]  # same micro-batch, same random draw
    assert runs[1][1] == pytest.approx(3.0, abs=0.01)  # the re-run's second micro-batch is clean
    assert machine.diagnostics == [(1, "initial_run"), (1, "first_rerun_not_reproducible")]
    assert machine.exit_request == (False, False, 0) and machine.state == RerunState.NOT_RUNNING_YET
    assert _step(machine, data, corrupt=[])[0][0] == pytest.approx(4.0, abs=0.01)  # the next step reads on


def test_persistent_error_saves_exits_16_and_the_resumed_job_exits_17(tmp_path: Path) -> None:
    tracker = tmp_path / "rejected.txt"
    machine = RerunStateMachine(VALIDATE, result_rejected_tracker_filename=str(tracker))
    data = RerunDataIterator(iter(range(100)))
    _step(machine, data, corrupt=[])
    _step(machine, data, corrupt=[(0, 0), (1, 0)])  # reproduced by the in-place re-run
    assert machine.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert machine.exit_request == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    saved = machine.checkpoint_state()
    assert (saved["mode"], saved["state"], saved["current_iteration"]) == ("validate_results", 3, 1)

    resumed = RerunStateMachine(VALIDATE, result_rejected_tracker_filename=str(tracker))
    assert resumed.load_checkpoint_state(saved)
    resumed.start_at(1)  # the loop's count after loading does not move a machine that is to re-run
    assert _step(resumed, RerunDataIterator(iter(range(2, 100))), corrupt=[(0, 0)])[0][1] == pytest.approx(3, abs=.01)
    assert resumed.exit_request == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    lines = tracker.read_text().splitlines()
    parsed = [TRACKER_LINE.search(line).groups() for line in lines]
    assert [(it, status.split(".")[-1].lower()) for _, _, it, status in parsed] == [  # Megatron's reading
        ("1", "initial_run"), ("1", "first_rerun_reproducible"), ("1", "second_rerun_reproducible")]
    assert all(line.endswith("message='loss check'") and "rank=0 " in line for line in lines)
    assert RerunStateMachine(VALIDATE).load_checkpoint_state(None) is False  # a checkpoint without the key


def test_tracker_file_iterations_megatron_would_skip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def line(job: str, rank: int, iteration: int, status: str) -> str:
        return (f"ts=2026-01-01 00:00:00 node=n device=0 jobID={job} rank={rank} iteration={iteration} "
                f"status={status} result=tensor(nan) message='m'\n")
    tracker = tmp_path / "rejected.txt"
    tracker.write_text(line("1", 0, 5, "initial_run") + line("1", 0, 5, "first_rerun_reproducible")
                       + line("2", 0, 5, "RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE")  # twice on rank 0: skip
                       + line("1", 1, 7, "first_rerun_reproducible") + line("2", 1, 7, "first_rerun_not_reproducible")
                       + line("3", 0, 9, "first_rerun_reproducible") + line("3", 1, 9, "first_rerun_reproducible")
                       + line("4", 0, 9, "first_rerun_reproducible"))  # two ranks of job 3: not skipped
    assert iterations_to_skip_from_tracker(str(tracker)) == [5]
    machine_for_run(Settings.from_args(None).with_values(rerun_mode="validate_results",
                                                         result_rejected_tracker_filename=str(tracker)))
    out = capsys.readouterr().out
    assert "Will skip these iterations from tracker file: [5]" in out
    assert "(--check-for-nan-in-loss-and-grad) go through it; its skip of a non-finite step stays" in out


def test_injected_errors_and_a_reproduced_non_fatal_spike() -> None:
    machine = RerunStateMachine(VALIDATE, RerunErrorInjector(1, RerunDiagnostic.PERSISTENT_ERROR))
    data = RerunDataIterator(iter(range(100)))
    _step(machine, data, corrupt=[])
    _step(machine, data, corrupt=[])  # every validation fails (rate 1); the re-run "reproduces" it
    assert machine.exit_request == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    resumed = RerunStateMachine(VALIDATE)
    resumed.load_checkpoint_state(machine.checkpoint_state())
    _step(resumed, RerunDataIterator(iter(range(2, 100))), corrupt=[])
    assert resumed.diagnostics == [(1, "second_rerun_not_reproducible")]
    assert resumed.exit_request == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)

    spiky = RerunStateMachine(VALIDATE)
    rule = lambda v: spiky.is_unexpectedly_large(v, threshold=10, context="loss", num_samples=4)  # noqa: E731
    data = RerunDataIterator(iter(range(1, 100)))
    for _ in range(3):
        _step(spiky, data, corrupt=[], fatal=False, rejection=rule)
    assert spiky.diagnostics == [] and spiky.max_values["loss"] == pytest.approx(6.0, abs=0.01)  # steps 1-2
    _step(spiky, data, corrupt=[(0, 0), (1, 0)], fatal=False, rejection=rule)  # 7000 >= 10 x 6: spiky, reproduced
    assert spiky.diagnostics == [(3, "initial_run"), (3, "first_rerun_reproducible")]
    assert spiky.exit_request == (False, False, 0) and spiky.state == RerunState.NOT_RUNNING_YET


def test_report_determinism_stats_reruns_every_step() -> None:
    machine = RerunStateMachine(RerunMode.REPORT_DETERMINISM_STATS)
    data = RerunDataIterator(iter(range(100)))
    for _ in range(3):
        assert len(_step(machine, data, corrupt=[])) == 2
    assert machine.last_report == {"loss check": (6, 0)}  # reported at iterations 0 and 2: 3 x 2 identical results


def test_disabled_runs_once_and_refusals_are_one_line(tmp_path: Path) -> None:
    machine = RerunStateMachine()
    assert len(_step(machine, iter(range(10)), corrupt=[])) == 1 and machine.diagnostics == []
    with pytest.raises(RuntimeError, match=r"iteration 1: Unexpected result nan \(message='loss check'\)"):
        _step(machine, iter(range(10)), corrupt=[(0, 0)])  # Megatron's rule (the loop does not validate then)
    base = Settings.from_args(None)
    with pytest.raises(RerunSettingsError, match="--rerun-mode validate_results with --deepspeed"):
        machine_for_run(base.with_values(rerun_mode="validate_results", deepspeed=True))
    with pytest.raises(RerunSettingsError, match="--check-for-spiky-loss acts through the rerun state machine"):
        machine_for_run(base.with_values(check_for_spiky_loss=True))
    with pytest.raises(RerunSettingsError, match="--rerun-mode validate_results: tasks/ finetuning does not"):
        refuse_outside_pretrain(base.with_values(rerun_mode="validate_results"), "tasks/ finetuning")
    with pytest.raises(RerunSettingsError, match="--iterations-to-skip: tasks/ finetuning does not skip"):
        refuse_outside_pretrain(base.with_values(iterations_to_skip=[3]), "tasks/ finetuning")
    refuse_outside_pretrain(base, "tasks/ finetuning")  # the defaults pass
    with pytest.raises(RerunTrackerError, match="--result-rejected-tracker-filename"):
        RerunStateMachine(VALIDATE, result_rejected_tracker_filename=str(tmp_path / "missing" / "x.txt"))


# ----------------------------------------------------------------------------------------------- through pretrain()
V = ("--rerun-mode", "validate_results")
TORCH_DIST = ("--ckpt-format", "torch_dist")


def _nan_once(at: int, on_rank: int = 0):
    """pretrain_gpt's forward step, whose `at`-th call on rank `on_rank` returns NaN token losses (once)."""
    from tests.harness import entry_providers

    original, calls = entry_providers("pretrain_gpt").forward_step, {"n": 0}

    def forward_step(data_iterator, model):
        output, loss_func = original(data_iterator, model)
        calls["n"] += torch.distributed.get_rank() == on_rank
        return (output * float("nan") if calls["n"] == at else output), loss_func
    return forward_step


def _pretrain(argv: list, forward_step=None) -> dict:
    """One pretrain() in this process: its losses, its exit code (0: returned), the machine's diagnostics and
    determinism report."""
    from megatron import global_vars
    from tests.ds._workers import _reset_megatron
    from tests.harness import pretrain_run

    history: dict = {}
    try:
        pretrain_run(argv, forward_step=forward_step, history=history)
        code = 0
    except SystemExit as exc:
        code = exc.code
    machine = global_vars.get_rerun_state_machine()
    out = {"losses": history.get("train_losses"), "code": code, "diagnostics": machine.diagnostics,
           "report": machine.last_report}
    _reset_megatron()
    return out


def _serial_job(rank: int, world: int, data: dict, tmp: str) -> list:
    from tests.reliability.helpers import train_argv

    base = train_argv(data, "--global-batch-size", "4", iters=4)  # 2 micro-batches per iteration
    inject = ("--error-injection-rate", "1", "--error-injection-type")
    persistent = [*base, *V, *inject, "persistent_error", "--result-rejected-tracker-filename"]
    jobs = [_pretrain(base), _pretrain([*base, *V], _nan_once(5)),  # iteration 3's first micro-batch
            _pretrain([*base, *V, *inject, "transient_error"]),  # every iteration from the 2nd fails once
            _pretrain([*persistent, f"{tmp}/rejected.txt", "--save", f"{tmp}/ckpt", "--save-interval", "100"]),
            _pretrain([*persistent, f"{tmp}/rejected.txt", "--load", f"{tmp}/ckpt"]),
            # (a tracker of its own: with the first one, iteration 1 would be skipped at the resume, as in Megatron)
            _pretrain([*persistent, f"{tmp}/dist.txt", *TORCH_DIST, "--save", f"{tmp}/dist", "--save-interval",
                       "100"]),
            _pretrain([*persistent, f"{tmp}/dist.txt", *TORCH_DIST, "--load", f"{tmp}/dist"])]
    # iteration 1 reproduced twice on rank 0 in the two trackers (Megatron's rule: skipped), and the flag's 2
    Path(f"{tmp}/both.txt").write_text(Path(f"{tmp}/rejected.txt").read_text() + Path(f"{tmp}/dist.txt").read_text())
    return [*jobs, _pretrain([*base, *V, "--result-rejected-tracker-filename", f"{tmp}/both.txt",
                              "--iterations-to-skip", "2", "--save", f"{tmp}/skip", "--save-interval", "100"])]


def _two_rank_job(rank: int, world: int, data: dict, tmp: str) -> list:
    from tests.reliability.helpers import train_argv

    base = train_argv(data, "--global-batch-size", "4", iters=4)
    pp2 = [*base, "--pipeline-model-parallel-size", "2"]
    persistent = [*pp2, *V, "--error-injection-rate", "1", "--error-injection-type", "persistent_error"]
    return [_pretrain(base), _pretrain([*base, *V], _nan_once(3)),  # DP2: rank 0's loss of iteration 3
            _pretrain([*base, "--rerun-mode", "report_determinism_stats", "--check-for-spiky-loss",
                       "--check-for-large-grads"]),
            _pretrain(pp2), _pretrain([*pp2, *V], _nan_once(5)),  # PP2: stage 1's output of iteration 3
            _pretrain([*base, *V, "--overlap-grad-reduce"], _nan_once(3)),  # grads checked after the reduction
            _pretrain([*persistent, "--save", f"{tmp}/pp2", "--save-interval", "100"]),  # every rank's state saved
            _pretrain([*persistent, "--load", f"{tmp}/pp2"])]


@pytest.mark.slow
def test_pretrain_reruns_transient_errors_exactly_and_stops_persistent_ones(tiny_data: dict, tmp_path: Path) -> None:
    from tests.dist_utils import run_distributed

    (clean, nan_hook, injected, first, resumed, dist_first, dist_resumed, skipping), = run_distributed(
        _serial_job, 1, args=(tiny_data, str(tmp_path)))
    assert clean["code"] == nan_hook["code"] == injected["code"] == 0 and len(clean["losses"]) == 4
    assert nan_hook["losses"] == clean["losses"]  # exactly: the re-run's results are the clean ones
    assert nan_hook["diagnostics"] == [(2, "initial_run"), (2, "first_rerun_not_reproducible")]
    assert injected["losses"] == clean["losses"]
    assert [s for _, s in injected["diagnostics"]] == ["initial_run", "first_rerun_not_reproducible"] * 3
    # persistent: iteration 2 reproduced in place -> checkpoint of iteration 1, exit 16; resumed: re-run, exit 17
    assert (first["code"], first["losses"]) == (EXIT_CODE_RESUME_TO_DISAMBIGUATE, {1: clean["losses"][1]})
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"
    saved = torch.load(tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert (saved["rerun_state_machine"]["state"], saved["rerun_state_machine"]["current_iteration"]) == (3, 1)
    assert (resumed["code"], resumed["losses"]) == (EXIT_CODE_FAILED_ON_RESULT_VALIDATION, {})
    statuses = [TRACKER_LINE.search(line).group(4).split(".")[-1].lower()
                for line in (tmp_path / "both.txt").read_text().splitlines()]
    assert statuses == ["initial_run", "first_rerun_reproducible", "second_rerun_not_reproducible"] * 2
    # the same through a torch_dist checkpoint (its common.pt carries the machine's state)
    assert (dist_first["code"], dist_resumed["code"]) == (16, 17) and dist_first["losses"] == first["losses"]
    assert dist_resumed["diagnostics"] == resumed["diagnostics"] == [(1, "second_rerun_not_reproducible")]
    # --iterations-to-skip: iterations 2 and 3 (1 and 2 counted from 0) read and dropped, not trained
    assert sorted(skipping["losses"]) == [1, 4] and skipping["losses"][1] == clean["losses"][1]
    saved = torch.load(tmp_path / "skip" / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert (saved["args"].skipped_train_samples, saved["consumed_train_samples"]) == (8, 16)

    rank0, rank1 = run_distributed(_two_rank_job, 2, args=(tiny_data, str(tmp_path)))
    dp_clean, dp_nan, dp_stats = rank0[:3]
    assert dp_nan["losses"] == dp_clean["losses"] and len(dp_clean["losses"]) == 4
    assert dp_nan["diagnostics"] == [(2, "initial_run"), (2, "first_rerun_not_reproducible")]  # rank 0's NaN
    assert rank1[1]["diagnostics"] == [] and rank1[1]["losses"] == dp_clean["losses"]  # rank 1 re-ran with it
    assert dp_stats["losses"] == dp_clean["losses"] and set(dp_stats["report"]) == {
        "found NaN in local forward loss calculation", "found Inf in local forward loss calculation",
        "found NaN in local grad norm in backward pass before data-parallel communication collective",
        "found Inf in local grad norm in backward pass before data-parallel communication collective",
        "Spiky loss", "found unexpected large grads in backward pass before data-parallel communication collective"}
    assert rank0[5]["losses"] == dp_clean["losses"] and rank0[5]["diagnostics"] == dp_nan["diagnostics"]
    pp_clean, pp_nan = rank1[3:5]  # the last stage's losses; stage 1 made them NaN through its output
    assert pp_nan["losses"] == pp_clean["losses"] and len(pp_clean["losses"]) == 4
    assert pp_nan["diagnostics"] == [(2, "initial_run"), (2, "first_rerun_not_reproducible")]
    # PP2, persistent: both stages' states in the checkpoint; each resumed stage re-runs from its own one
    assert [(r[6]["code"], r[7]["code"]) for r in (rank0, rank1)] == [(16, 17)] * 2
    assert [r[7]["diagnostics"] for r in (rank0, rank1)] == [[(1, "second_rerun_not_reproducible")]] * 2
    saved = torch.load(tmp_path / "pp2" / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    calls = [shard["failed_validation_call"] for shard in saved["rerun_state_machine"]["sharded"]]
    assert [(message[:28], rank) for (message, rank), _ in calls] == [  # Megatron's ((message, rank), sequence)
        ("found NaN in local grad norm", 0), ("found NaN in local forward l", 1)]  # stage 1 has no loss


def test_the_loop_saves_the_machine_state_then_exits_with_its_code(capsys: pytest.CaptureFixture) -> None:
    import types

    from megatron.nan_guard import SkipCounter
    from megatron.training import rerun_exit
    from megatron.training_state import TrainingState

    machine = RerunStateMachine(VALIDATE)
    data = RerunDataIterator(iter(range(100)))
    _step(machine, data, corrupt=[])
    _step(machine, data, corrupt=[(0, 0), (1, 0)])
    run, loop, held = TrainingState(iteration=1), types.SimpleNamespace(save="CKPT"), []
    guard = SkipCounter(10)
    with pytest.raises(SystemExit) as exited:
        rerun_exit(machine, 1, run, loop, lambda: held.append(run.rerun_state), guard)
    assert exited.value.code == 16 and held[0]["state"] == 3 and run.rerun_state is None
    assert "exiting with code 16 at iteration 2" in capsys.readouterr().out
    guard.update(1, skipped=True, nonfinite=True, loss_scale=None, min_loss_scale=None)  # a non-finite streak
    with pytest.raises(SystemExit):
        rerun_exit(machine, 1, run, loop, lambda: held.append(run.rerun_state), guard)
    assert held[1] is None and "no checkpoint was saved (a non-finite streak)" in capsys.readouterr().out


def test_a_skipped_iteration_is_counted_by_the_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--iterations-to-skip drives the machine as Megatron-LM's dummy_train_step does: a result rejected after a
    skipped iteration is named by its own iteration (before: one less per skipped iteration)."""
    tracker = tmp_path / "rejected.txt"
    machine = RerunStateMachine(VALIDATE, result_rejected_tracker_filename=str(tracker))
    monkeypatch.setattr(global_vars, "get_num_microbatches", lambda: 2)
    monkeypatch.setattr(global_vars, "get_rerun_state_machine", lambda: machine)
    data, run = RerunDataIterator(iter(range(100))), training_state.TrainingState()
    _step(machine, data, corrupt=[])  # iteration 0
    assert training.skip_iteration(data, run, types.SimpleNamespace(data_parallel_size=1, micro_batch_size=1)) == 1
    assert machine.current_iteration == 1 and run.skipped_train_samples == 2
    _step(machine, data, corrupt=[(0, 0)])  # iteration 2 reads samples 4 and 5
    assert machine.diagnostics == [(2, "initial_run"), (2, "first_rerun_not_reproducible")]
    assert [TRACKER_LINE.search(line).group(3) for line in tracker.read_text().splitlines()] == ["2", "2"]
