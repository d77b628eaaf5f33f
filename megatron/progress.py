"""Keeping a CPU run's threads and its silence in bounds.

`fit_cpu_threads` gives each local process its share of the machine's cores when the user has not chosen
(OMP_NUM_THREADS unset, no CUDA). `Heartbeat` is a daemon thread that prints one short line whenever 30 seconds of
wall time passed without one, naming what the run is doing: start-up (the process group, compiling the dataset
helpers), building the model and loading a checkpoint, building the datasets' index files, a long training iteration,
an evaluation, a checkpoint save. `ProgressNotes` adds the line after the first training iteration and keeps the
heartbeat's count between iterations, so a run with a large --log-interval is never silent for long either.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Optional

import torch

from megatron.core.rank_print import print_line, rank_and_world

QUIET_LIMIT_S = 30.0


def fit_cpu_threads(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Cap torch's intra-op threads at cores / local processes and its inter-op pool at 1, unless OMP_NUM_THREADS is
    set or CUDA runs the math. Never raises the thread count. Returns the intra-op threads set, or None."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS") or torch.cuda.is_available():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = max(1, int(env.get("LOCAL_WORLD_SIZE") or 1))
    threads = max(1, min(torch.get_num_threads(), cores // local))
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    try:
        if torch.get_num_interop_threads() > 1:
            torch.set_num_interop_threads(1)  # only once per process, before any inter-op work
    except RuntimeError:
        pass
    return threads


def print_on_first_rank(line: str) -> None:
    """Print `line` on global rank 0; before the process group exists, on the process whose RANK (torchrun's) is 0."""
    rank, world = rank_and_world()
    if world == 1 and os.environ.get("RANK", "0") not in ("", "0"):
        return
    if rank == 0:
        print_line(line)


class Heartbeat:
    """A daemon thread that prints ` > working: <what> (N s since the last line<note>)` whenever `quiet_limit_s` of
    wall time passed without a line, also inside one long step. `doing(what)` starts a phase (its start counts as a
    line: the caller prints one); `line_printed()` says a line went out; `check()` is the thread's test, callable
    directly with a fake clock."""

    def __init__(self, emit: Callable[[str], None] = print_on_first_rank, clock: Callable[[], float] = time.monotonic,
                 quiet_limit_s: float = QUIET_LIMIT_S) -> None:
        self.emit, self.clock, self.quiet_limit_s = emit, clock, quiet_limit_s
        self.what, self.note = "starting up", ""
        self.last_line = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def doing(self, what: str, note: str = "", new_phase: bool = True) -> None:
        """Name what the run does now; a new phase restarts the quiet-time count, a relabel (`new_phase=False`,
        the training iteration count) does not."""
        with self._lock:
            self.what, self.note = what, note
            if new_phase:
                self.last_line = self.clock()

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """`doing(what)` for the block, then the label it replaced again (its quiet-time count restarted)."""
        before = (self.what, self.note)
        self.doing(what)
        try:
            yield
        finally:
            self.doing(*before)

    def line_printed(self) -> None:
        """A line went out (a log line, a note): the quiet time starts again."""
        with self._lock:
            self.last_line = self.clock()

    def check(self) -> None:
        """Print one line when the run has been quiet for `quiet_limit_s` or longer."""
        with self._lock:
            now = self.clock()
            quiet = now - self.last_line
            if quiet < self.quiet_limit_s:
                return
            self.last_line = now
            line = f" > working: {self.what} ({quiet:.0f} s since the last line{self.note})"
        self.emit(line)

    def start(self) -> Heartbeat:
        """Start the thread (it polls a few times per quiet period); returns self."""
        if self._thread is None:
            self._stop.clear()
            self.line_printed()
            poll = max(0.01, min(1.0, self.quiet_limit_s / 4))

            def run() -> None:
                while not self._stop.wait(poll):
                    self.check()

            self._thread = threading.Thread(target=run, name="megatron-heartbeat", daemon=True)
            self._thread.start()
        return self

    @contextmanager
    def running(self, what: str) -> Iterator[None]:
        """The thread runs for the block, starting with the phase `what`."""
        self.doing(what)
        self.start()
        try:
            yield
        finally:
            self.stop()

    def started(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class ProgressNotes:
    """One line after the first iteration of a run (when the log line comes later); between iterations the heartbeat
    names the iteration reached and prints when QUIET_LIMIT_S passed since the last line; nothing when the log line
    itself comes often enough."""

    def __init__(self, start_iteration: int, train_iters: int, log_interval: int, emit: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, quiet_limit_s: float = QUIET_LIMIT_S,
                 heartbeat: Optional[Heartbeat] = None) -> None:
        self.start, self.train_iters, self.log_interval = start_iteration, train_iters, max(1, log_interval)
        self.emit, self.clock = emit, clock
        self.started = clock()
        self.beat = heartbeat if heartbeat is not None else Heartbeat(emit, clock, quiet_limit_s)
        self.beat.doing(f"the first iteration of this run ({start_iteration + 1} of {train_iters})", self._note())

    def _note(self) -> str:
        return f"; a log line every {self.log_interval} iterations"

    def after_iteration(self, iteration: int) -> None:
        """Called after each training iteration (after its log line, if any)."""
        now = self.clock()
        if iteration % self.log_interval == 0:  # the log line was printed
            self.beat.line_printed()
        elif iteration == self.start + 1:
            self.emit(f" > first iteration done in {now - self.started:.1f} s (iteration {iteration} of "
                      f"{self.train_iters}; a log line every {self.log_interval} iterations)")
            self.beat.line_printed()
        self.beat.doing(f"iteration {iteration} of {self.train_iters} done", self._note(), new_phase=False)
        self.beat.check()
