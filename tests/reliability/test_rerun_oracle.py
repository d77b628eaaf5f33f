"""Our rerun state machine (megatron/rerun_state_machine.py) against megatron-core 0.16.1's own RerunStateMachine.

The same scripted scenarios (tests/reliability/rerun_scenarios.py: clean; transient NaN; persistent NaN, 16 then 17
after resume, also resumed on the same device first; spiky loss transient and persistent; large grads; errors
injected by --error-injection-rate/-type; the disabled mode; report_determinism_stats over deterministic and
non-deterministic results) drive ours in-process and Megatron's in one oracle subprocess, and each step's answers
(should_run_forward_backward, should_checkpoint_and_exit), the results of each run, the spiky/large-grads bookkeeping,
the machine's log lines, the tracker file's lines, the iterations Megatron's reader of that file would skip, the
checkpoint entry saved under ``rerun_state_machine`` and the determinism stats are compared. Each machine's saved entry is then loaded by the
other's resumed job, which must finish as the original did. The deliberate differences are asserted as such (see
docs/reliability.md).
"""
from __future__ import annotations

import copy
import io
import json
import pickle
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import megatron.rerun_state_machine as ours
from megatron.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunStateMachine,
    iterations_to_skip_from_tracker,
)
from tests.mcore_oracle import require_oracle, run_oracle
from tests.reliability.rerun_scenarios import MICRO_BATCHES, SCENARIOS, run_scenario

HERE = Path(__file__).resolve().parent
CROSS = "persistent_nan"  # the scenario whose checkpoint entry each side's resumed job loads from the other
SKIPPED = "persistent_nan_correct"  # the scenario whose tracker file each side's reader reads from the other
# Tracker lines of several jobs and ranks, in both spellings of a status (Megatron's reader: an iteration counted
# twice on one rank is skipped unless one job counted it on several ranks; only "reproducible"/"disabled" count)
CRAFTED = "".join(
    f"ts=2026-01-01 00:00:00 node=n{rank} device=0 jobID={job} rank={rank} iteration={it} status={status} "
    f"result=nan message='m'\n"
    for job, rank, it, status in [
        ("1", 0, 5, "RerunValidationStatus.INITIAL_RUN"), ("1", 0, 5, "RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE"),
        ("2", 0, 5, "second_rerun_reproducible"), ("1", 0, 7, "rerun_disabled"), ("1", 1, 7, "rerun_disabled"),
        ("1", 0, 7, "RerunValidationStatus.RERUN_DISABLED"), ("3", 2, 9, "first_rerun_reproducible"),
        ("4", 2, 9, "RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE"), ("4", 3, 11, "first_rerun_not_reproducible"),
        ("4", 3, 11, "second_rerun_not_reproducible")])

# Megatron's module without megatron/core/__init__.py (which imports most of megatron-core: ~6 s): stand-in package
# objects whose __path__ is the oracle's folders, so only rerun_state_machine.py and the few modules it imports load.
# Its CUDA calls get stand-ins: the current device is the scenario's (so that its same-node/GPU rule can be driven),
# the CUDA RNG state is empty, and its all-reduce of flags runs on the CPU (gloo, one rank).
ORACLE_SCRIPT = r'''
import json, logging, os, pickle, sys, types
import torch
ORACLE = {oracle!r}
for name, sub in (("megatron", ""), ("megatron.core", "/core"), ("megatron.core.dist_checkpointing",
                                                                  "/core/dist_checkpointing")):
    package = types.ModuleType(name)
    package.__path__ = [ORACLE + "/megatron" + sub]
    sys.modules[name] = package
DEVICE = [0]
torch.cuda.current_device = lambda: DEVICE[0]
torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(1, dtype=torch.uint8)
torch.cuda.set_rng_state = lambda *a, **k: None
import megatron.core.rerun_state_machine as rsm
from megatron.core.dist_checkpointing.mapping import ShardedObject


class _Torch(types.ModuleType):
    def __getattr__(self, name):
        return getattr(torch, name)


rsm.torch = _Torch("torch")
rsm.torch.tensor = lambda *a, device=None, **k: torch.tensor(*a, **k)  # its flags' all-reduce on the CPU
torch.distributed.init_process_group("gloo", init_method="file://" + os.path.abspath("pg"), rank=0, world_size=1)
sys.path.insert(0, {scenarios!r})
import rerun_scenarios as S
from enum import Enum


def plain(x):
    """A checkpoint entry as plain values: enums by value, the sharded object by its data, named tuples as tuples."""
    if isinstance(x, Enum):
        return x.value
    if isinstance(x, ShardedObject):
        return plain(x.data)
    if isinstance(x, dict):
        return {{k: plain(v) for k, v in x.items()}}
    if isinstance(x, tuple):
        return tuple(plain(v) for v in x)
    if isinstance(x, list):
        return [plain(v) for v in x]
    return x


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.extend(record.getMessage().splitlines())


LOG = _Lines()
rsm.logger.addHandler(LOG)
rsm.logger.setLevel(logging.INFO)
rsm.logger.propagate = False


class Api:
    mod = rsm

    def take_log(self):
        lines, LOG.lines = LOG.lines, []
        return lines

    def make(self, mode, tracker, rate, kind):
        rsm.destroy_rerun_state_machine()
        rsm.initialize_rerun_state_machine(
            mode=rsm.RerunMode(mode), result_rejected_tracker_filename=tracker,
            error_injector=rsm.RerunErrorInjector(rate, rsm.RerunDiagnostic(kind)))
        return rsm.get_rerun_state_machine()

    def save(self, machine, data):
        return plain(machine.state_dict(data, "torch_dist"))

    def load(self, machine, sd):
        sd = dict(sd, state=rsm.RerunState(sd["state"]))  # its state is a plain Enum: a value never equals it
        if isinstance(sd["sharded"], list):  # ours holds every rank's entry; its sharded object loads as the rank's
            sd["sharded"] = sd["sharded"][0]
        if machine.validate_state_dict(sd):
            machine.load_state_dict(sd)

    def set_device(self, device):
        DEVICE[0] = device

    def stats(self, machine):
        return {{caller.message: s for caller, s in machine.stats.items()}}

    def skipped(self, path):
        return rsm.RerunStateMachine.get_skipped_iterations_from_tracker_file(path)


api, out = Api(), {{}}
# 0.16.1's report_determinism_stats names callers by fields its Caller lacks: the first report raises
out["unpatched_report"] = S.run_scenario(api, "stats_deterministic", "t_unpatched.txt")["jobs"][0]["steps"][0]["error"]


class _Caller(rsm.Caller):
    filename, lineno = "<scenario>", 0


rsm.Caller = _Caller  # so that the rest of its report_determinism_stats runs
saved = {{}}
for name in S.SCENARIOS:
    record = S.run_scenario(api, name, f"t_{{name}}.txt")
    saved[name] = record.pop("raw_saved")
    out[name] = record
out["cross"] = S.run_scenario(api, {cross!r}, "t_cross.txt", load_from="ours_saved.pkl")
out["cross"].pop("raw_saved")
out["skip_ours_tracker"] = api.skipped("ours_tracker.txt")
out["skip_crafted"] = api.skipped("crafted.txt")
with open("megatron_saved.pkl", "wb") as f:
    pickle.dump(saved[{cross!r}][0], f)
with open("out.json", "w") as f:
    json.dump(out, f)
'''


class OursApi:
    """The adapter of rerun_scenarios.py for our machine (the device: what the module's `_device` answers)."""

    mod = ours

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch, self.out = monkeypatch, io.StringIO()
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: torch.zeros(1, dtype=torch.uint8))
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: None)

    def take_log(self) -> list[str]:
        lines = self.out.getvalue().splitlines()
        self.out.seek(0)
        self.out.truncate()
        return lines

    def make(self, mode: str, tracker: str, rate: int, kind: str) -> RerunStateMachine:
        return RerunStateMachine(RerunMode(mode), RerunErrorInjector(rate, RerunDiagnostic(kind)), tracker)

    def save(self, machine: RerunStateMachine, data: object) -> dict:
        return machine.checkpoint_state()

    def load(self, machine: RerunStateMachine, sd: dict) -> None:
        machine.load_checkpoint_state(sd)

    def set_device(self, device: int) -> None:
        self.monkeypatch.setattr(ours, "_device", lambda: device)

    def stats(self, machine: RerunStateMachine) -> dict:
        return dict(machine.stats)

    def skipped(self, path: str) -> list[int]:
        return iterations_to_skip_from_tracker(path)


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """(ours, Megatron's) records of every scenario, plus the cross-loaded resumes under "cross"."""
    work = tmp_path_factory.mktemp("rerun_oracle")
    mine, saved = {}, {}
    python_rng, numpy_rng = random.getstate(), np.random.get_state()  # the scenarios seed the global generators
    with pytest.MonkeyPatch.context() as monkeypatch, torch.random.fork_rng(devices=[]):
        api = OursApi(monkeypatch)
        monkeypatch.setattr(sys, "stdout", api.out)  # the machine's lines (it prints them)
        for name in SCENARIOS:
            record = run_scenario(api, name, str(work / f"o_{name}.txt"))
            saved[name] = record.pop("raw_saved")
            mine[name] = record
        (work / "ours_saved.pkl").write_bytes(pickle.dumps(saved[CROSS][0]))
        (work / "ours_tracker.txt").write_text((work / f"o_{SKIPPED}.txt").read_text())
        (work / "crafted.txt").write_text(CRAFTED)
        run_oracle(ORACLE_SCRIPT.format(oracle=str(require_oracle()), scenarios=str(HERE), cross=CROSS), work)
        mine["cross"] = run_scenario(api, CROSS, str(work / "o_cross.txt"), load_from=str(work / "megatron_saved.pkl"))
        mine["cross"].pop("raw_saved")
        mine["skip_megatron_tracker"] = iterations_to_skip_from_tracker(str(work / f"t_{SKIPPED}.txt"))
        mine["skip_crafted"] = iterations_to_skip_from_tracker(str(work / "crafted.txt"))
    random.setstate(python_rng)
    np.random.set_state(numpy_rng)
    theirs = json.loads((work / "out.json").read_text())
    return json.loads(json.dumps(mine)), theirs


def _comparable(record: dict, mine: bool) -> dict:
    """A scenario's record with the checkpoint entries in one layout: ours holds every rank's entry in a list (one
    here), Megatron's sharded object loads as the rank's own; the data iterator's micro-batches (Megatron's: the
    step's, to replay; ours: None, the resumed loader reads the step's samples again) are checked and dropped."""
    record = copy.deepcopy(record)
    for job in record["jobs"]:
        for step in job["steps"]:
            step["log"] = _log_lines(step["log"], mine)
        saved = job["saved"]
        if saved is None:
            continue
        if mine:
            assert isinstance(saved["sharded"], list) and len(saved["sharded"]) == 1
            saved["sharded"] = saved["sharded"][0]
            assert saved["sharded"].pop("data_iterator_checkpoints") is None
        else:
            first = MICRO_BATCHES * saved["current_iteration"]
            assert saved["sharded"].pop("data_iterator_checkpoints") == [
                {"saved_microbatches": list(range(first, first + MICRO_BATCHES)), "replaying": True, "replay_pos": 0}]
    return record


def _log_lines(lines: list[str], mine: bool) -> list[str]:
    """The machine's log lines but: the level ours prints first on its failure lines (Megatron's logger adds its
    own), the caller of each determinism stats line (0.16.1 names fields its Caller lacks: the oracle patches in a
    placeholder) and its "initialized" line in the disabled mode (ours says nothing then: the default run's log
    stays as it was); the stats lines sorted (Megatron goes through a set of callers, ours through sorted
    messages)."""
    lines = [re.sub(r"^(ERROR|WARNING): ", "", line) if mine else line for line in lines]
    lines = [line for line in lines if not line.startswith("  From ")
             and line != "RerunStateMachine initialized in mode RerunMode.DISABLED"]
    stats = [i for i, line in enumerate(lines) if line.startswith("    ")]
    for i, line in zip(stats, sorted(lines[i] for i in stats)):
        lines[i] = line
    return lines


@pytest.mark.parametrize("name", sorted(set(SCENARIOS) - {"transient_nan"}))
def test_each_step_answers_results_tracker_and_checkpoint_match_megatron(both: tuple[dict, dict], name: str) -> None:
    mine, theirs = both
    assert _comparable(mine[name], True) == _comparable(theirs[name], False)


def test_the_scenarios_exercise_what_they_name(both: tuple[dict, dict]) -> None:
    mine, _ = both

    def exits(name: str) -> list:
        return [step["exit"] for job in mine[name]["jobs"] for step in job["steps"] if step["exit"][1:2] == [True]]

    def statuses(name: str) -> list:
        return [(int(line.split(" iteration=")[1].split()[0]), line.split(" status=")[1].split()[0].split(".")[-1])
                for line in mine[name]["tracker"]]

    assert exits("persistent_nan") == [[True, True, 16], [False, True, 17]]
    assert exits("persistent_nan_same_device") == [[True, True, 16], [False, True, 16], [False, True, 17]]
    assert statuses("persistent_nan_correct") == [(2, "INITIAL_RUN"), (2, "FIRST_RERUN_REPRODUCIBLE"),
                                                  (2, "SECOND_RERUN_REPRODUCIBLE")]
    assert mine["persistent_nan_correct"]["skipped"] == [2]
    assert statuses("spiky_persistent") == [(4, "INITIAL_RUN"), (4, "FIRST_RERUN_REPRODUCIBLE")]
    assert statuses("large_grads") == [(4, "INITIAL_RUN"), (4, "FIRST_RERUN_NOT_REPRODUCIBLE"), (6, "INITIAL_RUN"),
                                       (6, "FIRST_RERUN_REPRODUCIBLE")]
    assert exits("spiky_transient") == exits("large_grads") == exits("clean") == []
    assert mine["transient_inf_in_first_step"]["tracker"] == []  # a job's first step is never validated
    # the same seed draws the same injections in both (python's `random`, whose state a re-run restores, so the
    # draw of each step repeats): every step from the first validated one
    assert [it for it, status in statuses("injected_transient") if status == "INITIAL_RUN"] == list(range(1, 10))
    assert exits("injected_persistent") == exits("injected_correct") == [[True, True, 16], [False, True, 17]]
    assert mine["disabled_nan"]["jobs"][0]["steps"][-1]["error"].startswith("RuntimeError: Rank 0, node ")
    assert statuses("disabled_nan") == [(2, "RERUN_DISABLED")]


def test_a_transient_fatal_error_continues_here_where_megatron_saves_and_exits_17(both: tuple[dict, dict]) -> None:
    """The deliberate difference (docs/reliability.md): the same re-run and tracker lines; Megatron then asks for a
    checkpoint and exit 17, ours trains on with the re-run's results."""
    mine, theirs = both
    ours_steps, their_steps = mine["transient_nan"]["jobs"][0]["steps"], theirs["transient_nan"]["jobs"][0]["steps"]
    assert mine["transient_nan"]["tracker"] == theirs["transient_nan"]["tracker"]
    assert [s["runs"] for s in ours_steps[:3]] == [s["runs"] for s in their_steps]
    assert ours_steps[2]["answers"] == their_steps[2]["answers"] == [True, True, False]
    assert their_steps[2]["exit"] == [True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION]
    assert ours_steps[2]["exit"] == [False, False, 0] and len(ours_steps) == 7
    assert all(step["answers"] == [True, False] and step["exit"] == [False, False, 0] for step in ours_steps[3:])


def test_report_determinism_stats_match_and_megatrons_report_raises(both: tuple[dict, dict]) -> None:
    """The distributions of relative differences match (deterministic: all identical; with a drift between runs:
    every sample differs); megatron-core 0.16.1's report line itself raises (its Caller has no filename/lineno:
    the oracle patches that in to compare the rest), ours prints one line per check."""
    mine, theirs = both
    assert theirs["unpatched_report"] == "AttributeError: 'Caller' object has no attribute 'filename'"
    last = {name: mine[name]["jobs"][0]["steps"][-1]["stats"] for name in ("stats_deterministic",
                                                                             "stats_nondeterministic")}
    assert all(step["error"] is None for step in mine["stats_deterministic"]["jobs"][0]["steps"])
    assert [(v[0], v[1]) for v in last["stats_deterministic"].values()] == [(8, []), (4, [])]  # NaN loss check, grads
    assert all(v[0] == 0 and len(v[1]) in (4, 8) and min(v[1]) > 0 for v in last["stats_nondeterministic"].values())


def test_each_side_resumes_from_the_others_checkpoint_entry(both: tuple[dict, dict]) -> None:
    """Ours resumed from Megatron's saved entry (its values, its sharded object's layout) re-runs the iteration as
    Megatron did; Megatron's resumed from ours (its loader needs its RerunState enum: the oracle wraps the value,
    and takes this rank's entry of our list) as ours did."""
    mine, theirs = both
    assert _comparable(mine["cross"], True)["jobs"][1:] == _comparable(theirs[CROSS], False)["jobs"][1:]
    assert mine["cross"]["tracker"] == theirs[CROSS]["tracker"]
    assert _comparable(theirs["cross"], False)["jobs"][1:] == _comparable(mine[CROSS], True)["jobs"][1:]
    assert theirs["cross"]["tracker"] == mine[CROSS]["tracker"]


def test_each_reader_of_the_tracker_skips_what_the_other_does(both: tuple[dict, dict]) -> None:
    mine, theirs = both
    assert mine["skip_megatron_tracker"] == theirs["skip_ours_tracker"] == [2]
    assert mine["skip_crafted"] == theirs["skip_crafted"] == [5, 9]


def test_flat_calls_of_older_checkpoints_still_load() -> None:
    machine = RerunStateMachine(RerunMode.VALIDATE_RESULTS)
    own = {"rerun_requested": True, "checkpoint_requested": True, "restart_again_requested": False,
           "continue_requested": False, "error_injector_checkpoint": RerunErrorInjector().state_dict(),
           "failed_validation_call": ("m", 0, 3), "initial_result": torch.tensor(float("nan")),
           "suspicious_node": "n", "suspicious_device": None, "data_iterator_checkpoints": None,
           "large_value_counts": {}, "max_values": {}}
    assert machine.load_checkpoint_state({"mode": "validate_results", "state": 3, "current_iteration": 4,
                                          "sharded": [own]})
    assert machine.failed_validation_call == ours.Call(ours.Caller("m", 0), 3)
