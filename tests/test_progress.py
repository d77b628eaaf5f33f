"""megatron/progress.py: the first-iteration line and the 30-second heartbeat of a training run (between iterations,
inside one long step, and in the phases before and around training), and the CPU thread cap that applies only when
OMP_NUM_THREADS is unset."""
from __future__ import annotations

import threading

import torch

from megatron.progress import Heartbeat, ProgressNotes, fit_cpu_threads


def test_first_iteration_then_a_line_only_after_30_quiet_seconds() -> None:
    now = [0.0]
    lines: list[str] = []
    notes = ProgressNotes(0, 300, 25, lines.append, clock=lambda: now[0])
    for it, t in [(1, 4.0), (2, 10.0), (3, 33.0), (4, 35.0), (25, 70.0), (26, 71.0), (27, 99.0), (28, 101.5)]:
        now[0] = t
        notes.after_iteration(it)
    assert lines == [
        " > first iteration done in 4.0 s (iteration 1 of 300; a log line every 25 iterations)",
        " > working: iteration 4 of 300 done (31 s since the last line; a log line every 25 iterations)",
        " > working: iteration 28 of 300 done (32 s since the last line; a log line every 25 iterations)",
    ]


def test_resumed_runs_and_log_interval_one_add_nothing_when_lines_come_often() -> None:
    now = [0.0]
    lines: list[str] = []
    notes = ProgressNotes(150, 300, 1, lines.append, clock=lambda: now[0])
    for it in range(151, 200):
        now[0] += 5.0
        notes.after_iteration(it)
    assert lines == []
    resumed = ProgressNotes(150, 300, 25, lines.append, clock=lambda: 2.0)
    resumed.after_iteration(151)
    assert lines == [" > first iteration done in 0.0 s (iteration 151 of 300; a log line every 25 iterations)"]


def test_thread_cap_only_without_omp_num_threads() -> None:
    before = torch.get_num_threads()
    try:
        assert fit_cpu_threads({"OMP_NUM_THREADS": "3"}) is None and torch.get_num_threads() == before
        if not torch.cuda.is_available():
            assert fit_cpu_threads({"LOCAL_WORLD_SIZE": "100000"}) == 1 and torch.get_num_threads() == 1
            assert torch.get_num_interop_threads() >= 1
            torch.set_num_threads(1)
            assert fit_cpu_threads({}) == 1  # never raises the count the process chose
    finally:
        torch.set_num_threads(before)


def test_heartbeat_names_the_phase_inside_one_long_step() -> None:
    now = [0.0]
    lines: list[str] = []
    beat = Heartbeat(lines.append, clock=lambda: now[0])
    beat.doing("building the datasets (and their index files, on a first run)")
    for t in (10.0, 29.9, 30.0, 45.0, 61.0):
        now[0] = t
        beat.check()
    with beat.phase("saving the checkpoint of iteration 10"):
        now[0] = 95.0
        beat.check()
        beat.line_printed()
        now[0] = 120.0
        beat.check()
    now[0] = 151.0
    beat.check()
    assert lines == [" > working: building the datasets (and their index files, on a first run) (30 s since the last line)",
                     " > working: building the datasets (and their index files, on a first run) (31 s since the last line)",
                     " > working: saving the checkpoint of iteration 10 (34 s since the last line)",
                     " > working: building the datasets (and their index files, on a first run) (31 s since the last line)"]


def test_heartbeat_thread_prints_while_the_main_thread_is_busy() -> None:
    """The real thread, with a 20 ms quiet limit: a line arrives while the main thread waits (no sleep: an event)."""
    got = threading.Event()
    lines: list[str] = []
    beat = Heartbeat(lambda line: (lines.append(line), got.set()), quiet_limit_s=0.02)
    beat.doing("compiling the dataset index helpers")
    beat.start()
    try:
        assert got.wait(10)
    finally:
        beat.stop()
    assert lines[0].startswith(" > working: compiling the dataset index helpers (")
