"""Keeping a CPU run's threads and its silence in bounds.

`fit_cpu_threads` gives each local process its share of the machine's cores when the user has not chosen
(OMP_NUM_THREADS unset, no CUDA); `ProgressNotes` prints one short line after the first training iteration and
whenever 30 seconds passed without a log line, so a run with a large --log-interval is never silent for long.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Mapping, Optional

import torch

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


class ProgressNotes:
    """One line after the first iteration of a run (when the log line comes later) and one whenever QUIET_LIMIT_S
    passed since the last line, naming the iteration; nothing when the log line itself comes often enough."""

    def __init__(self, start_iteration: int, train_iters: int, log_interval: int, emit: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, quiet_limit_s: float = QUIET_LIMIT_S) -> None:
        self.start, self.train_iters, self.log_interval = start_iteration, train_iters, max(1, log_interval)
        self.emit, self.clock, self.quiet_limit_s = emit, clock, quiet_limit_s
        self.started = self.last_line = clock()

    def after_iteration(self, iteration: int) -> None:
        now = self.clock()
        if iteration % self.log_interval == 0:  # the log line was printed
            self.last_line = now
        elif iteration == self.start + 1:
            self.emit(f" > first iteration done in {now - self.started:.1f} s (iteration {iteration} of "
                      f"{self.train_iters}; a log line every {self.log_interval} iterations)")
            self.last_line = now
        elif now - self.last_line >= self.quiet_limit_s:
            self.emit(f" > working: iteration {iteration} of {self.train_iters} ({now - self.last_line:.0f} s since "
                      f"the last line; a log line every {self.log_interval} iterations)")
            self.last_line = now
