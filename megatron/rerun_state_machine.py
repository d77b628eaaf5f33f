"""Megatron-LM's result-validation / rerun state machine (--rerun-mode), as megatron-core 0.16.1 defines it.

Checks of a step's results (a NaN/Inf local loss or grad norm, a spiky loss, unexpectedly large grads) call
`RerunStateMachine.validate_result`. In ``validate_results`` mode a rejected result makes the step run again in place
on the same micro-batches (`RerunDataIterator` replays them) and the same RNG state:

* not reproduced: a transient error, logged; training continues with the re-run's results (for every check: Megatron
  0.16.1 continues after a non-fatal check only and saves and exits 17 after a fatal one, the NaN/Inf checks; here
  a transient NaN costs one re-run, not the job);
* reproduced, for a fatal check: a checkpoint is saved (carrying this machine's state under the key
  ``rerun_state_machine``) and the job exits with `EXIT_CODE_RESUME_TO_DISAMBIGUATE` (16); the job resumed from it
  re-runs the iteration (state RERUNNING_FROM_CHECKPOINT) and exits with `EXIT_CODE_FAILED_ON_RESULT_VALIDATION` (17)
  whatever the comparison says (Megatron's rule), after logging whether it was reproduced there; on a GPU the resumed
  job must land on another node/device than the suspicious one, else it exits 16 again (no such check on CPU: there is
  no device to avoid);
* reproduced, for a non-fatal check (spiky loss, large grads): training continues.

``report_determinism_stats`` re-runs every step once and reports, every 2 iterations, the relative differences between
the two runs' results (Megatron's stats line). Every event of a validation is appended to
--result-rejected-tracker-filename in Megatron's format (``ts=... node=... device=... jobID=... rank=...
iteration=... status=... result=... message='...'``). `RerunErrorInjector` (--error-injection-rate/-type) makes
results look rejected and their re-runs match or mismatch as the chosen diagnostic would.

With --rerun-mode disabled the loop does not call the machine (--check-for-nan-in-loss-and-grad skips a non-finite
step); called anyway, `validate_result` does what Megatron's does then (a tracker line; a fatal rejection raises).
tests/reliability/test_rerun_oracle.py runs megatron-core 0.16.1's machine beside this one; docs/reliability.md names
the deliberate differences.

The loop owns one machine (megatron/global_vars.py holds it); the step receives it explicitly. Iterations are counted
from 0 (the iteration being trained, as Megatron's tracker lines count them).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import random
import re
from collections import defaultdict
from enum import Enum
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

import numpy as np
import torch

from megatron.errors import MegatronUserError

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16  # resume the job from the checkpoint just saved, on another node/device
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17  # the result was rejected after re-running it

COMPARISON_MATCH = 0.0
COMPARISON_MISMATCH = math.inf
REPORTING_INTERVAL_ITERATIONS = 2  # report_determinism_stats: the stats lines every this many iterations


class RerunDiagnostic(str, Enum):
    """What a rejected result turned out to be (and what --error-injection-type simulates)."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, Enum):
    """--rerun-mode."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(Enum):
    """Where the machine is in a step: before/after the (re-)runs, the initial run, the in-place re-run, about to
    re-run from a checkpoint (saved in it), re-running from it, or asked to resume from it again."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


# After a step's (re-)runs in validate_results mode, the states that end the job: (save a checkpoint first, the exit
# code, Megatron's message).
_EXIT_REQUESTS = {
    RerunState.RERUNNING_IN_PLACE: (
        True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
        "Exiting now. A checkpoint at the last iteration is being saved if further examination is needed"),
    RerunState.WILL_RERUN_FROM_CHECKPOINT: (
        True, EXIT_CODE_RESUME_TO_DISAMBIGUATE,
        "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last iteration "
        "and establish a diagnostic"),
    RerunState.RERUNNING_FROM_CHECKPOINT: (
        False, EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
        "Exiting now. A checkpoint at the last iteration already exists if further examination is needed"),
    RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT: (
        False, EXIT_CODE_RESUME_TO_DISAMBIGUATE,
        "Exiting now. Please resume the job from the same checkpoint to rerun the last iteration and establish a "
        "diagnostic"),
}


class RerunValidationStatus(str, Enum):
    """The status of a line of the tracker file."""

    RERUN_DISABLED = "rerun_disabled"
    INITIAL_RUN = "initial_run"
    FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
    FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
    SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
    SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"


class Caller(NamedTuple):
    """Where validate_result calls come from: their message and the rank (Megatron's key of a step's calls)."""

    message: str
    rank: int


class Call(NamedTuple):
    """One validate_result call of a step: its caller and its sequence number among that caller's (Megatron's
    layout: a checkpoint holds it as ``((message, rank), sequence)``)."""

    caller: Caller
    sequence: int

    @classmethod
    def from_saved(cls, saved: Optional[Any]) -> Optional[Call]:
        """A checkpoint's value (Megatron's nested layout, or the flat ``(message, rank, sequence)`` that this
        module wrote before) as a Call."""
        if saved is None:
            return None
        if len(saved) == 3:
            return cls(Caller(str(saved[0]), int(saved[1])), int(saved[2]))
        caller, sequence = saved
        return cls(Caller(str(caller[0]), int(caller[1])), int(sequence))


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _device() -> Optional[int]:
    """This process's CUDA device under NCCL, else None (a CPU run)."""
    if torch.cuda.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_backend() == "nccl":
        return torch.cuda.current_device()
    return None


def _say(message: str, every_rank: bool = False) -> None:
    """One log line (rank 0's only unless `every_rank`)."""
    if every_rank or _rank() == 0:
        print(message, flush=True)


def compare_floats(a: torch.Tensor, b: torch.Tensor) -> float:
    """Megatron's default comparison of two 0-dim results: 0 when equal (or both NaN), inf when one is NaN/Inf and the
    other not, else the relative difference |a - b| / mean(a, b)."""
    af, bf = float(a), float(b)
    if af == bf or (math.isnan(af) and math.isnan(bf)):
        return COMPARISON_MATCH
    if math.isnan(af) or math.isnan(bf) or math.isinf(af) or math.isinf(bf):
        return COMPARISON_MISMATCH
    return math.fabs((af - bf) / (af + bf) * 2)


class RerunDataIterator:
    """A data iterator that records the micro-batches of a step so that a re-run replays them (`rewind`), and drops
    them when the next step starts (`advance`)."""

    def __init__(self, iterable: Iterator) -> None:
        self.iterable = iterable
        self.saved_microbatches: list = []
        self.replaying = False
        self.replay_pos = 0

    def __iter__(self) -> RerunDataIterator:
        return self

    def __next__(self) -> Any:
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError("a re-run of the step asked for more micro-batches than the initial run read")
            item = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            return item
        item = next(self.iterable)
        self.saved_microbatches.append(item)
        return item

    def rewind(self) -> None:
        """Replay from the step's first micro-batch."""
        self.replaying, self.replay_pos = True, 0

    def advance(self) -> None:
        """Forget the recorded micro-batches: the next step reads new ones."""
        self.replaying, self.saved_microbatches = False, []


class QuickStats:
    """The distribution of one validation's relative differences between runs (report_determinism_stats)."""

    def __init__(self, max_size: int = 100000) -> None:
        self.samples: list[float] = []
        self.pos = 0
        self.zero_cnt = 0
        self.max = 0.0
        self.max_size = max_size

    def record(self, data: float) -> None:
        """Add one sample (zeros are only counted)."""
        if data == 0.0:
            self.zero_cnt += 1
            return
        if self.pos < self.max_size:
            self.samples.append(data)
        else:
            self.samples[self.pos % self.max_size] = data
        self.pos += 1
        self.max = max(self.max, data)

    def combine(self, others: list[QuickStats]) -> None:
        """Add other ranks' samples."""
        if not others:
            return
        n = len(self.samples) + sum(len(o.samples) for o in others)
        if n <= self.max_size:
            for other in others:
                self.samples.extend(other.samples)
            self.pos = n
        self.zero_cnt += sum(o.zero_cnt for o in others)
        self.max = max(self.max, max(o.max for o in others))

    def reset(self) -> None:
        """Forget every sample."""
        self.samples, self.pos, self.zero_cnt, self.max = [], 0, 0, 0.0

    def print_stats(self) -> str:
        """Megatron's stats line: totals, average and percentiles of the relative differences."""
        self.samples.sort()
        z, n = self.zero_cnt, len(self.samples)
        if n == 0:
            return f"{z:,} samples, all identical"
        t = z + n
        ps = {p: (f"{self.samples[int(t * p) - z]:.3E}" if int(t * p) - z >= 0 else "0.0")
              for p in (0.5, 0.9, 0.99, 0.999)}
        return (f"{t:,}/{z:,} total/identical samples, rel. variability: avg= {sum(self.samples) / t:.3E}, "
                f"p50= {ps[0.5]}, p90= {ps[0.9]}, p99= {ps[0.99]}, p99.9= {ps[0.999]}, max: {self.max:.3E}")


class RerunErrorInjector:
    """--error-injection-rate N: on average one validation in N is made to fail (per rank, Megatron's draw from
    python's `random`); --error-injection-type decides how its re-runs compare."""

    NAMES = {RerunDiagnostic.CORRECT_RESULT: "Expected result", RerunDiagnostic.TRANSIENT_ERROR: "Transient error",
             RerunDiagnostic.PERSISTENT_ERROR: "Persistent error"}

    def __init__(self, error_injection_rate: int = 0,
                 error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR) -> None:
        self.error_injection_rate = int(error_injection_rate)
        self.error_injection_type = RerunDiagnostic(error_injection_type)
        self.injected_error_type: Optional[RerunDiagnostic] = None  # set while an injected error is being handled

    def maybe_inject(self) -> bool:
        """Whether to make this validation fail (never twice before the first one was handled)."""
        if self.error_injection_rate <= 0 or self.injected_error_type is not None:
            return False
        if (random.randint(0, self.error_injection_rate - 1) + _rank()) % self.error_injection_rate != 0:
            return False
        self.injected_error_type = self.error_injection_type
        _say(f"Injecting error type {self.NAMES[self.error_injection_type]}", every_rank=True)
        return True

    def maybe_miscompare(self, comparison_func: Callable[[Any, Any], float], initial_result: Any, result: Any,
                         state: RerunState) -> float:
        """The comparison of a re-run with the initial run, as the injected diagnostic makes it look."""
        injected = self.injected_error_type
        if injected is None:
            return comparison_func(initial_result, result)
        if state == RerunState.RERUNNING_IN_PLACE:
            if injected == RerunDiagnostic.TRANSIENT_ERROR:
                self.injected_error_type = None
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        if state == RerunState.RERUNNING_FROM_CHECKPOINT and injected != RerunDiagnostic.TRANSIENT_ERROR:
            self.injected_error_type = None
            return COMPARISON_MISMATCH if injected == RerunDiagnostic.PERSISTENT_ERROR else COMPARISON_MATCH
        raise RuntimeError(f"injected {injected.value} compared in state {state.name}")

    def state_dict(self) -> dict:
        """Plain values for a checkpoint."""
        injected = self.injected_error_type
        return {"error_injection_rate": self.error_injection_rate,
                "error_injection_type": self.error_injection_type.value,
                "injected_error_type": None if injected is None else injected.value}

    def load_state_dict(self, sd: dict) -> None:
        """Inverse of `state_dict`."""
        self.error_injection_rate = int(sd["error_injection_rate"])
        self.error_injection_type = RerunDiagnostic(sd["error_injection_type"])
        injected = sd.get("injected_error_type")
        self.injected_error_type = None if injected is None else RerunDiagnostic(injected)


@dataclasses.dataclass
class _Requests:
    """The per-rank flags of a step that are all-reduced over the job (any rank asking is enough)."""

    rerun: bool = False  # a validation failed: re-run in place
    checkpoint: bool = False  # reproduced in place: checkpoint, resume elsewhere
    restart_again: bool = False  # resumed on the suspicious node/device: resume again
    proceed: bool = False  # resume normal execution (not fatal, or not reproduced)


DataIterators = Union[None, Iterator, list]


class RerunStateMachine:
    """The state machine (see the module docstring). The step drives it::

        while machine.should_run_forward_backward(data_iterator):
            ...forward/backward; machine.validate_result(...) on the results...
        should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()

    `state_save_func` / `state_restore_func`: what else must be put back for a re-run (the loop passes the
    tensor-parallel RNG tracker's states; python, numpy, torch and CUDA generators are saved here)."""

    def __init__(self, mode: RerunMode = RerunMode.DISABLED, error_injector: Optional[RerunErrorInjector] = None,
                 result_rejected_tracker_filename: Optional[str] = None,
                 state_save_func: Optional[Callable[[], Any]] = None,
                 state_restore_func: Optional[Callable[[Any], None]] = None) -> None:
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1
        self.first_iteration_complete = False
        self.requests = _Requests()
        self.logged_enabled = False
        self.error_injector = error_injector or RerunErrorInjector()
        self.validation_counts: dict[Caller, int] = defaultdict(int)
        self.failed_validation_call: Optional[Call] = None
        self.initial_result: Any = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Optional[int] = None
        self.tracker = result_rejected_tracker_filename
        if self.tracker is not None:
            try:
                with open(self.tracker, "a"):
                    pass
            except OSError as exc:
                raise RerunTrackerError(f"--result-rejected-tracker-filename {self.tracker} cannot be appended to "
                                        f"({exc.strerror}): pass a writable path") from None
        self.state_save_func, self.state_restore_func = state_save_func, state_restore_func
        self.saved_state: Optional[dict] = None
        self.large_value_counts: dict[str, int] = {}
        self.max_values: dict[str, float] = {}
        self.saved_results: dict[Call, Any] = {}
        self.stats: dict[str, QuickStats] = defaultdict(QuickStats)
        self.diagnostics: list[tuple[int, str]] = []  # (iteration, status) of every validation event, for callers
        self.exit_request: tuple[bool, bool, int] = (False, False, 0)  # the last should_checkpoint_and_exit()
        self.last_report: dict[str, tuple[int, int]] = {}  # report_determinism_stats: (identical, differing) counts
        if self.mode != RerunMode.DISABLED:
            _say(f"RerunStateMachine initialized in mode {self.mode}")  # as Megatron's f-string shows the enum

    # ------------------------------------------------------------------------------------------- collectives
    def _reduce_any(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag OR-ed over every rank of the job (one all-reduce)."""
        if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            return tuple(bool(f) for f in flags)
        device = torch.device("cuda", torch.cuda.current_device()) if _device() is not None else torch.device("cpu")
        values = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(values)
        return tuple(v > 0 for v in values.tolist())

    # ------------------------------------------------------------------------------------------- the step
    def should_run_forward_backward(self, data_iterator: DataIterators) -> bool:
        """Whether to (re-)run the step's forward-backward now; moves the machine along (port of Megatron's
        RerunStateMachine.should_run_forward_backward)."""
        self.validation_counts = defaultdict(int)
        iterators = self._iterators(data_iterator)
        state = self.state
        if state == RerunState.NOT_RUNNING_YET:
            self.current_iteration += 1
            self.state = RerunState.INITIAL_RUN
            if self.mode != RerunMode.DISABLED:
                self._save_state()
                for it in iterators:
                    it.advance()
                self.requests = _Requests()
            return True
        if state == RerunState.INITIAL_RUN:
            if self.mode == RerunMode.DISABLED or not self._reduce_any(self.requests.rerun)[0]:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if self.mode == RerunMode.VALIDATE_RESULTS:
                _say("Need to rerun step to check reproducibility of initial result")
            self.state = RerunState.RERUNNING_IN_PLACE
            self._rewind(iterators)
            return True
        if state == RerunState.RERUNNING_IN_PLACE:
            return self._after_rerun_in_place(iterators)
        if state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self.state = RerunState.RERUNNING_FROM_CHECKPOINT
            return True
        if state == RerunState.RERUNNING_FROM_CHECKPOINT:
            restart_again, proceed = self._reduce_any(self.requests.restart_again, self.requests.proceed)
            if restart_again:
                _say("Need to restart job from the same checkpoint because it was scheduled on the same node/GPU")
                self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            elif proceed:
                _say("Continuing normal execution because failed validation was not fatal")
                self.state = RerunState.NOT_RUNNING_YET
            return False
        raise RuntimeError(f"should_run_forward_backward called in state {state.name}")

    def _after_rerun_in_place(self, iterators: list[RerunDataIterator]) -> bool:
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            self.state = RerunState.NOT_RUNNING_YET
            self._maybe_report_stats()
            self.saved_results = {}
            return False
        proceed, checkpoint = self._reduce_any(self.requests.proceed, self.requests.checkpoint)
        if proceed:
            _say("Continuing normal execution because failed validation was not fatal")
            self.state = RerunState.NOT_RUNNING_YET
            return False
        if checkpoint:
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
        self._rewind(iterators)
        return False

    def _rewind(self, iterators: list[RerunDataIterator]) -> None:
        self._restore_state()
        for it in iterators:
            it.rewind()

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """(save a checkpoint now, exit now, the exit code) after the step's (re-)runs; also kept as
        `exit_request` for the loop."""
        self.first_iteration_complete = True
        self.exit_request = self._exit_request() if self.mode == RerunMode.VALIDATE_RESULTS else (False, False, 0)
        return self.exit_request

    def _exit_request(self) -> tuple[bool, bool, int]:
        request = _EXIT_REQUESTS.get(self.state)
        if request is None:
            return False, False, 0
        checkpoint, code, message = request
        _say(message)
        return checkpoint, True, code

    # ------------------------------------------------------------------------------------------- validation
    def validate_result(self, result: Any, rejection_func: Callable[[Any], Any], message: str,
                        comparison_func: Optional[Callable[[Any, Any], float]] = None, tolerance: float = 0.0,
                        fatal: bool = True) -> None:
        """Check one result of the step: `rejection_func(result)` true rejects it (the step is re-run to attribute
        it); `comparison_func` (default `compare_floats`) and `tolerance` decide whether a re-run reproduced it;
        `fatal`: whether a reproduced rejection stops the job (else training continues). Calls must come in the same
        order in every run of a step."""
        if self.mode == RerunMode.DISABLED:  # the loop does not call it then (--check-for-nan-in-loss-and-grad
            self._validate_disabled(result, rejection_func, message, fatal)  # skips a step): Megatron's rule
            return
        comparison_func = comparison_func or compare_floats
        if self.state == RerunState.NOT_RUNNING_YET:
            raise RuntimeError("validate_result called outside of the forward-backward of a step")
        call = self._call(message)
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            if self.state == RerunState.INITIAL_RUN:
                self.requests.rerun = True
                self.saved_results[call] = result
            elif self.state == RerunState.RERUNNING_IN_PLACE:
                self.stats[message].record(comparison_func(self.saved_results[call], result))
            return
        if not self.logged_enabled:
            self.logged_enabled = True
            _say("Result validation enabled")
        if self.state == RerunState.INITIAL_RUN:
            if not self.requests.rerun and self.first_iteration_complete:  # the first step is never validated
                self._check_initial(call, result, rejection_func, message)
        elif self.state in (RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT) \
                and call == self.failed_validation_call:
            comparison = self.error_injector.maybe_miscompare(comparison_func, self.initial_result, result, self.state)
            if self.state == RerunState.RERUNNING_IN_PLACE:
                self._first_rerun(result, message, comparison > tolerance, fatal)
            else:
                self._second_rerun(result, message, comparison > tolerance, fatal)

    def _validate_disabled(self, result: Any, rejection_func: Callable[[Any], Any], message: str,
                           fatal: bool) -> None:
        """Megatron's validation without re-runs: a rejected result is logged to the tracker (rerun_disabled) and
        raises RuntimeError when `fatal` (else a warning line)."""
        if not bool(rejection_func(result)):
            return
        self._record(RerunValidationStatus.RERUN_DISABLED, result, message)
        device = _device()
        full = (f"Rank {_rank()}, node {os.uname()[1]}, device {'cpu' if device is None else device}, "
                f"iteration {self.current_iteration}: Unexpected result {_shown(result)} (message='{message}')")
        if fatal:
            raise RuntimeError(full)
        _say(full, every_rank=True)

    def _check_initial(self, call: Call, result: Any, rejection_func: Callable[[Any], Any], message: str) -> None:
        if not (self.error_injector.maybe_inject() or bool(rejection_func(result))):
            return
        self.failed_validation_call, self.initial_result = call, _detached(result)
        self.requests.rerun = True
        self._record(RerunValidationStatus.INITIAL_RUN, result, message)
        _say(f"Unexpected result {_shown(result)} on rank {_rank()} at iteration #{self.current_iteration} "
             f"invocation #{call.sequence} (message='{message}')", every_rank=True)

    def _first_rerun(self, result: Any, message: str, differs: bool, fatal: bool) -> None:
        initial = _shown(self.initial_result)
        if differs:
            self.requests.proceed = True  # not reproduced: the step goes on with the re-run's results (Megatron
            # 0.16.1 does so for a non-fatal check only and stops a fatal one with exit 17; see the module docstring)
            self._record(RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE, result, message)
            self._failure(f"First rerun: unexpected result is not reproducible within the tolerance "
                          f"({_shown(result)} != {initial})", fatal)
            self._failure("Possible transient error!", fatal)
            return
        if fatal:
            self.requests.checkpoint = True
        else:
            self.requests.proceed = True
        self.suspicious_node, self.suspicious_device = os.uname()[1], _device()
        self._record(RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, result, message)
        self._failure(f"First rerun: unexpected result is reproducible within the tolerance ({_shown(result)} = "
                      f"{initial}). Need to rerun on a different GPU to verify correctness.", fatal)

    def _second_rerun(self, result: Any, message: str, differs: bool, fatal: bool) -> None:
        device = _device()
        initial = _shown(self.initial_result)
        if device is not None and (os.uname()[1], device) == (self.suspicious_node, self.suspicious_device):
            _say(f"Got rescheduled on the same GPU. Need to resume again from the same checkpoint (node: "
                 f"{self.suspicious_node}, gpu: {self.suspicious_device})", every_rank=True)
            self.requests.restart_again = True
            return
        if differs:
            self._record(RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE, result, message)
            _say(f"Second rerun: unexpected result is not reproducible on a different GPU, therefore was likely "
                 f"incorrect ({_shown(result)} != {initial})", every_rank=True)
            self._failure("Possible persistent error!", True)
        else:
            self._record(RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE, result, message)
            _say(f"Second rerun: unexpected result is reproducible on a different GPU, therefore it was likely "
                 f"correct ({_shown(result)} = {initial})", every_rank=True)
            self._failure(f"Correct result (but possible Application error) ({message})", True)
        if not fatal:
            self.requests.proceed = True

    def _failure(self, what: str, fatal: bool) -> None:
        level = "ERROR" if fatal else "WARNING"
        device = _device()
        _say(f"{level}: Rank {_rank()}, node {os.uname()[1]}, device {'cpu' if device is None else device}, "
             f"iteration #{self.current_iteration}: {what}!", every_rank=True)

    def is_unexpectedly_large(self, result: torch.Tensor, threshold: float, context: str, num_samples: int = 100,
                              resample: bool = False) -> bool:
        """Megatron's rule for spiky losses and large grads: |result| >= `threshold` x the largest |value| of the
        first `num_samples` values seen under `context` (those first values are never flagged; NaN/Inf neither:
        other checks catch them)."""
        value = math.fabs(float(result))
        if math.isnan(value) or math.isinf(value):
            return False
        if resample or context not in self.large_value_counts:
            self.large_value_counts[context] = 0
        if self.large_value_counts[context] < num_samples:
            self.large_value_counts[context] += 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            if self.large_value_counts[context] == num_samples:
                _say(f"Max value for {context}: {self.max_values[context]}")
            return False
        return value >= self.max_values[context] * threshold

    def _call(self, message: str) -> Call:
        caller = Caller(message, _rank())
        self.validation_counts[caller] += 1
        return Call(caller, self.validation_counts[caller])

    # ------------------------------------------------------------------------------------------- re-run state
    def _iterators(self, data_iterator: DataIterators) -> list[RerunDataIterator]:
        if self.mode == RerunMode.DISABLED:
            return []
        found = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        found = [d for d in found if d is not None]
        for d in found:
            if not isinstance(d, RerunDataIterator):
                raise RuntimeError("--rerun-mode needs the training data iterator wrapped in RerunDataIterator")
        return found

    def _save_state(self) -> None:
        """What a re-run must start from besides the micro-batches: the RNG states (and `state_save_func`'s)."""
        self.saved_state = {
            "random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if _device() is not None else None,
            "other": self.state_save_func() if self.state_save_func else None,
        }

    def _restore_state(self) -> None:
        saved = self.saved_state
        if saved is None:  # re-running from a checkpoint: the loaded RNG state is the step's
            return
        random.setstate(saved["random"])
        np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["torch"])
        if saved["cuda"] is not None:
            torch.cuda.set_rng_state(saved["cuda"])
        if saved["other"] is not None and self.state_restore_func:
            self.state_restore_func(saved["other"])

    def start_at(self, iteration: int) -> None:
        """The loop's iteration count after loading a checkpoint (`iteration` steps done); a machine restored from
        the checkpoint keeps the iteration it is to re-run."""
        if self.state == RerunState.NOT_RUNNING_YET:
            self.current_iteration = iteration - 1

    # ------------------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> Optional[dict]:
        """The checkpoint's ``rerun_state_machine`` entry: None unless a step is to be re-run from the checkpoint
        (Megatron's rule: other checkpoints keep their bytes); else the mode, state and iteration and, under
        ``sharded``, every rank's own state in global-rank order (gathered here: collective over the job)."""
        if self.state == RerunState.NOT_RUNNING_YET or self.mode == RerunMode.DISABLED:
            return None
        call = self.failed_validation_call
        own = {
            "rerun_requested": self.requests.rerun, "checkpoint_requested": self.requests.checkpoint,
            "restart_again_requested": self.requests.restart_again, "continue_requested": self.requests.proceed,
            "error_injector_checkpoint": self.error_injector.state_dict(),
            "failed_validation_call": None if call is None else (tuple(call.caller), call.sequence),
            "initial_result": self.initial_result, "suspicious_node": self.suspicious_node,
            "suspicious_device": self.suspicious_device,
            "data_iterator_checkpoints": None,  # the loader resumes at the step's first sample: it replays them
            "large_value_counts": dict(self.large_value_counts), "max_values": dict(self.max_values),
        }
        sharded = [own]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            sharded = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(sharded, own)
        return {"mode": self.mode.value, "state": self.state.value, "current_iteration": self.current_iteration,
                "sharded": sharded}

    def load_checkpoint_state(self, sd: Optional[dict]) -> bool:
        """Restore `checkpoint_state`'s entry (None, or a checkpoint of another world size: ignored, with a line);
        True when a step is now to be re-run from the checkpoint. `sd["sharded"]` may also be this rank's own entry
        (a dict: what Megatron's sharded object loads as), with Megatron's enums or their values."""
        if not sd or RerunState(int(_value(sd.get("state", 0)))) == RerunState.NOT_RUNNING_YET:
            return False
        if self.mode == RerunMode.DISABLED:
            _say("RerunStateMachine disabled via CLI, ignoring machine state saved in checkpoint")
            return False
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        sharded = sd["sharded"]
        if isinstance(sharded, dict):
            sharded = [None] * _rank() + [sharded]
        elif not isinstance(sharded, list) or len(sharded) != world:
            _say("Job sharding has changed: Rerun state will be ignored")
            return False
        _say("Getting RerunStateMachine state from checkpoint. Will rerun step.")
        self.mode = RerunMode(_value(sd["mode"]))
        self.state = RerunState(int(_value(sd["state"])))
        self.current_iteration = int(sd["current_iteration"])
        own = sharded[_rank()]
        self.requests = _Requests(bool(own["rerun_requested"]), bool(own["checkpoint_requested"]),
                                  bool(own["restart_again_requested"]), bool(own["continue_requested"]))
        self.error_injector.load_state_dict(own["error_injector_checkpoint"])
        self.failed_validation_call = Call.from_saved(own["failed_validation_call"])
        self.initial_result = own["initial_result"]
        self.suspicious_node, self.suspicious_device = own["suspicious_node"], own["suspicious_device"]
        self.large_value_counts = dict(own["large_value_counts"])
        self.max_values = dict(own["max_values"])
        self.saved_state = None
        return True

    # ------------------------------------------------------------------------------------------- reports
    def _maybe_report_stats(self) -> None:
        """report_determinism_stats: every REPORTING_INTERVAL_ITERATIONS iterations rank 0 prints each validation's
        distribution of relative differences over every rank (gathered: collective)."""
        if self.current_iteration % REPORTING_INTERVAL_ITERATIONS != 0:
            return
        everyone = [dict(self.stats)]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            everyone = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, dict(self.stats))
        if _rank() != 0:
            for stats in self.stats.values():
                stats.reset()
            return
        print("Stats on computation determinism in validation calls", flush=True)
        for message in sorted({m for s in everyone for m in s}):
            mine = self.stats[message]
            mine.combine([s[message] for s in everyone[1:] if message in s])
            self.last_report[message] = (mine.zero_cnt, len(mine.samples))
            print(f"  From {message}:", flush=True)
            print(f"    {mine.print_stats()}", flush=True)

    def _record(self, status: RerunValidationStatus, result: Any, message: str) -> None:
        """One line in --result-rejected-tracker-filename (Megatron's format: the status as its f-string shows the
        enum, ``RerunValidationStatus.INITIAL_RUN`` on Python 3.11+, which its reader of the file takes) and in
        `diagnostics`."""
        self.diagnostics.append((self.current_iteration, status.value))
        if self.tracker is None:
            return
        device = _device()
        line = (f"ts={datetime.datetime.now()} node={os.uname()[1]} device={'cpu' if device is None else device} "
                f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={_rank()} iteration={self.current_iteration} "
                f"status={status} result={result} message='{message}'\n")
        try:
            with open(self.tracker, "a") as f:
                f.write(line)
        except OSError as exc:
            _say(f"Could not log validation error! ({exc})", every_rank=True)


class RerunTrackerError(MegatronUserError, ValueError):
    """--result-rejected-tracker-filename cannot be written (one line: the path and the fix)."""


def _value(x: Any) -> Any:
    """An enum's value, or the value itself (checkpoints hold plain values)."""
    return x.value if isinstance(x, Enum) else x


def _detached(result: Any) -> Any:
    return result.detach().to("cpu").clone() if isinstance(result, torch.Tensor) else result


def _shown(result: Any) -> str:
    """A result in a message, as Megatron's f-strings show it (a 0-dim tensor as its float)."""
    return f"{result}"


_TRACKER_LINE = re.compile(r"ts=.+ node=.+ device=.+ jobID=(.+) rank=(.+) iteration=(.+) status=(.+) result=.+ "
                           r"message=.+")
_COUNTED = ("RERUN_DISABLED", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_REPRODUCIBLE")


def iterations_to_skip_from_tracker(path: str) -> list[int]:
    """Megatron's reading of a tracker file (RerunStateMachine.get_skipped_iterations_from_tracker_file): the
    iterations whose result was rejected and reproduced (or rejected with re-runs disabled) twice on the same rank,
    except those rejected on more than one rank of one job: the training loop skips them (--iterations-to-skip)."""
    potential: set[int] = set()
    ignored: set[int] = set()
    seen: set[tuple[int, int]] = set()
    by_job: dict[str, dict[int, set[int]]] = {}
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return []
    for line in lines:
        match = _TRACKER_LINE.search(line)
        if not match or str(match[4]).split(".")[-1].upper() not in _COUNTED:
            continue
        job, rank, iteration = str(match[1]), int(match[2]), int(match[3])
        if (rank, iteration) in seen:
            potential.add(iteration)
        seen.add((rank, iteration))
        ranks = by_job.setdefault(job, {}).setdefault(iteration, set())
        ranks.add(rank)
        if len(ranks) > 1:
            ignored.add(iteration)
    return sorted(potential - ignored)


class RerunSettingsError(MegatronUserError, ValueError):
    """A rerun flag that this run cannot honour (one line: the flags and the fix)."""


_NEEDS_A_MODE = {"check_for_spiky_loss": "--check-for-spiky-loss", "check_for_large_grads": "--check-for-large-grads",
                 "error_injection_rate": "--error-injection-rate",
                 "result_rejected_tracker_filename": "--result-rejected-tracker-filename"}


def machine_for_run(settings: Any, state_save_func: Optional[Callable[[], Any]] = None,
                    state_restore_func: Optional[Callable[[Any], None]] = None) -> RerunStateMachine:
    """The run's machine from its Settings (--rerun-mode, --error-injection-rate/-type,
    --result-rejected-tracker-filename); the flags that only act through the machine are refused in one line
    without a mode, and a mode with --deepspeed (whose engine steps the model itself)."""
    mode = RerunMode(settings.value("rerun_mode"))
    if mode == RerunMode.DISABLED:
        for name, flag in _NEEDS_A_MODE.items():
            if settings.value(name):
                raise RerunSettingsError(f"{flag} acts through the rerun state machine: add --rerun-mode "
                                         "validate_results (or drop it)")
    elif settings.value("deepspeed"):
        raise RerunSettingsError(f"--rerun-mode {mode.value} with --deepspeed: DeepSpeed's engine runs the "
                                 "forward-backward itself and cannot re-run a step; use --rerun-mode disabled")
    if mode == RerunMode.VALIDATE_RESULTS:
        nan = ("the NaN/Inf loss and grad checks (--check-for-nan-in-loss-and-grad) go through it; its skip of a "
               "non-finite step stays for what they let through (a job's first step is not validated)"
               if settings.value("check_for_nan_in_loss_and_grad") else "no NaN/Inf check "
               "(--no-check-for-nan-in-loss-and-grad)")
        _say(f"--rerun-mode validate_results: a step whose result a check rejects is re-run to attribute it; {nan}")
    tracker = settings.value("result_rejected_tracker_filename")
    skipped = iterations_to_skip_from_tracker(tracker) if tracker else []
    if skipped:
        _say(f"Will skip these iterations from tracker file: {skipped}")
    injector = RerunErrorInjector(settings.value("error_injection_rate"),
                                  RerunDiagnostic(settings.value("error_injection_type")))
    return RerunStateMachine(mode, injector, tracker, state_save_func, state_restore_func)


def refuse_outside_pretrain(settings: Any, loop: str) -> None:
    """A training loop other than pretrain()'s (`loop` names it) does not drive the machine: the rerun flags and
    --iterations-to-skip are refused there in one line (those that need a mode as `machine_for_run` refuses them)."""
    machine_for_run(settings)
    if settings.value("iterations_to_skip"):
        raise RerunSettingsError(f"--iterations-to-skip: {loop} does not skip iterations (pretrain_gpt.py, "
                                 "pretrain_bert.py and pretrain_t5.py do); drop it")
    mode = settings.value("rerun_mode")
    if mode != RerunMode.DISABLED.value:
        raise RerunSettingsError(f"--rerun-mode {mode}: {loop} does not re-run steps (pretrain_gpt.py, "
                                 "pretrain_bert.py and pretrain_t5.py do); use --rerun-mode disabled")
