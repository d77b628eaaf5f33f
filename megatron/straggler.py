"""Straggler detection (Megatron-LM's --log-straggler): which rank is slow, reported every --log-interval.

Each rank times its own forward steps in training (data loading + forward compute of every micro-batch, wall clock, so
it works on CPU; on a GPU the timer synchronises the device before reading the clock). Time spent waiting for other
ranks in the backward's gradient all-reduce or the pipeline's sends is not in it, so a slow rank shows up as its own
larger time rather than as everybody's. At each log interval every rank contributes its average time per iteration
(one all-gather) and rank 0 prints Megatron's min/max line::

    [2026-11-29 01:02:03] | MnRtt/Rnk: 12.31ms/0 | MxRtt/Rnk: 212.80ms/3 | MnEtpt/Rnk: 0.00TF/3 | MxEtpt/Rnk: 0.01TF/0

(Rtt: the timed time per iteration; Etpt: the iteration's FLOPs / Rtt / world size / 3, Megatron's estimate that
leaves out the backward pass; Megatron's GPU power, temperature, utilisation, clock and get_batch fields are left out:
there is no NVML here and get_batch is inside the timed step), the `^^^^ Bottom/Top N Ranks` lines with
--straggler-minmax-count N > 1, and, beyond Megatron, one line naming the ranks (and hosts) whose time exceeds
--straggler-threshold x the median of the other ranks: the line a clean run never prints.

Control as Megatron's: rank 0 listens on --straggler-ctrlr-port (any TCP/HTTP connection, e.g. ``curl host:port``,
toggles collection, effective at the next report, which broadcasts rank 0's state); --disable-straggler-on-startup
starts it off. Tensor-parallel ranks wait for their group's first rank in the data broadcast, so a slow rank makes its
whole tensor-parallel group look slow (Megatron's detector finds the straggling group the same way).
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import socket
import statistics
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron.errors import ArgumentError

AMP = 3.0  # Megatron's factor: the timed forward is about a third of an iteration's FLOPs


@dataclasses.dataclass(frozen=True)
class StragglerReport:
    """One interval's figures: per-rank milliseconds per iteration and estimated TFLOP/s, and the named ranks."""

    times_ms: list[float]
    tflops: list[float]
    stragglers: list[int]
    median_ms: float


def find_stragglers(times_ms: list[float], threshold: float) -> tuple[list[int], float]:
    """Ranks whose time exceeds `threshold` x the median of the other ranks' times (with two ranks: the other one's),
    and the median of all ranks' times."""
    named = []
    for rank, t in enumerate(times_ms):
        others = times_ms[:rank] + times_ms[rank + 1:]
        if others and t > threshold * statistics.median(others) > 0:
            named.append(rank)
    return named, statistics.median(times_ms)


def _value(value: float, rank: int, unit: str) -> str:
    return f"{value:.2f}{unit}/{rank}"


def report_lines(report: StragglerReport, minmax_count: int, hosts: list[str], threshold: float) -> list[str]:
    """Megatron's min/max line (and top/bottom lines), then the line naming the stragglers if there are any."""
    times, flops = report.times_ms, report.tflops
    lo, hi = min(range(len(times)), key=times.__getitem__), max(range(len(times)), key=times.__getitem__)
    order = sorted(range(len(flops)), key=lambda r: (flops[r], r))
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    lines = [f"[{now}] | MnRtt/Rnk: {_value(times[lo], lo, 'ms')} | MxRtt/Rnk: {_value(times[hi], hi, 'ms')} | "
             f"MnEtpt/Rnk: {_value(flops[order[0]], order[0], 'TF')} | "
             f"MxEtpt/Rnk: {_value(flops[order[-1]], order[-1], 'TF')}"]
    world = len(times)
    if 1 < minmax_count < world:
        lines.append("^^^^ Bottom {} Ranks with lowest  Etpt(TF): {}".format(
            minmax_count, "".join(f" {flops[r]:.2f}/{r}," for r in order[:minmax_count])))
        lines.append("^^^^ Top    {} Ranks with highest Etpt(TF): {}".format(
            minmax_count, "".join(f" {flops[r]:.2f}/{r}," for r in order[world - minmax_count:])))
    if report.stragglers:
        named = ", ".join(f"{r} ({hosts[r]}: {times[r]:.1f}ms)" for r in report.stragglers)
        lines.append(f"straggler: rank(s) {named} took more than {threshold:g}x the other ranks' "
                     f"median per iteration over the last interval (median of all: {report.median_ms:.1f}ms)")
    return lines


class _Controller:
    """Rank 0's toggle listener: every connection flips the `toggle` request (read at the next report)."""

    def __init__(self, port: int) -> None:
        self.toggle = False
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        weakref.finalize(self, self.sock.close)
        threading.Thread(target=self._serve, name="straggler-controller", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(1024)
                except OSError:
                    pass
                self.toggle = not self.toggle
                msg = "StragglerDetector will toggle at the next logging interval"
                conn.sendall(f"HTTP/1.0 200 OK\r\nConnection: Close\r\nContent-length: {len(msg)}\r\n\r\n{msg}"
                             .encode())
            print(msg, flush=True)

    def take(self) -> bool:
        """Whether a toggle was asked since the last call (and forget it)."""
        asked, self.toggle = self.toggle, False
        return asked

    def close(self) -> None:
        self.sock.close()


class StragglerDetector:
    """Times this rank's training forward steps and reports all ranks' times every log interval (a collective:
    every rank of `group` calls `report` at the same iterations). `group` None: one process, no collectives."""

    def __init__(self, *, enabled: bool = True, port: Optional[int] = 65535, minmax_count: int = 1,
                 threshold: float = 2.0, group: Any = None) -> None:
        self.group = group
        distributed = group is not None or (dist.is_available() and dist.is_initialized())
        self.rank = dist.get_rank(group) if distributed else 0
        self.world = dist.get_world_size(group) if distributed else 1
        self.distributed = distributed
        self.on = enabled
        self.minmax_count = minmax_count
        self.threshold = threshold
        self.elapsed_s = 0.0
        self.hosts = self._gather_hosts()
        self.controller: Optional[_Controller] = None
        if self.rank == 0 and port is not None:
            try:
                self.controller = _Controller(port)
                print(f"StragglerDetector: toggle with a connection to port {self.controller.port} of this host; "
                      f"now {'ON' if enabled else 'OFF'}", flush=True)
            except OSError as err:  # Megatron warns and goes on without the controller
                print(f"warning: StragglerDetector cannot be controlled: port {port}: {err}", flush=True)

    @classmethod
    def for_run(cls, log: Any, group: Any = None) -> Optional[StragglerDetector]:
        """The detector --log-straggler asks for (`log`: the run's LogSettings), None without it."""
        if not log.log_straggler:
            return None
        if not log.straggler_threshold > 0 or log.straggler_minmax_count < 1:
            raise ArgumentError(f"--straggler-threshold must be > 0 (got {log.straggler_threshold}) and "
                                f"--straggler-minmax-count >= 1 (got {log.straggler_minmax_count})")
        return cls(enabled=not log.disable_straggler_on_startup, port=log.straggler_ctrlr_port,
                   minmax_count=log.straggler_minmax_count, threshold=log.straggler_threshold, group=group)

    def _gather_hosts(self) -> list[str]:
        host = socket.gethostname()
        if not self.distributed:
            return [host]
        hosts: list[Any] = [None] * self.world
        dist.all_gather_object(hosts, host, group=self.group)
        return [str(h) for h in hosts]

    def timed(self, forward_step_func: Callable) -> Callable:
        """`forward_step_func` with its calls timed (while collection is on)."""
        @functools.wraps(forward_step_func)
        def timed_step(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return forward_step_func(*args, **kwargs)
            start = time.perf_counter()
            out = forward_step_func(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.elapsed_s += time.perf_counter() - start
            return out
        return timed_step

    def report(self, total_flops: float, log_interval: int) -> Optional[StragglerReport]:
        """Gather every rank's time per iteration over the last `log_interval` iterations (which did
        `total_flops`), print the lines on rank 0, then apply a toggle rank 0 was asked for. None while off."""
        result = None
        if self.on and log_interval > 0:
            mine = torch.tensor([1e3 * self.elapsed_s / log_interval], dtype=torch.float64)
            if self.distributed:
                gathered = [torch.zeros_like(mine) for _ in range(self.world)]
                dist.all_gather(gathered, mine, group=self.group)
                times = [float(t.item()) for t in gathered]
            else:
                times = [float(mine.item())]
            per_iter = total_flops / log_interval
            flops = [per_iter / (t * 1e9 * self.world) / AMP if t > 0 else 0.0 for t in times]
            named, median = find_stragglers(times, self.threshold)
            result = StragglerReport(times_ms=times, tflops=flops, stragglers=named, median_ms=median)
            if self.rank == 0:
                for line in report_lines(result, self.minmax_count, self.hosts, self.threshold):
                    print(line, flush=True)
        self.elapsed_s = 0.0
        self._apply_toggle()
        return result

    def _apply_toggle(self) -> None:
        flip = torch.tensor([int(self.controller.take()) if self.controller is not None else 0], dtype=torch.int64)
        if self.distributed:
            dist.broadcast(flip, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                           group=self.group)
        if int(flip.item()):
            self.on = not self.on
            if self.rank == 0:
                print(f"StragglerDetector is now {'ON' if self.on else 'OFF'}", flush=True)

    def close(self) -> None:
        """Stop listening on the control port."""
        if self.controller is not None:
            self.controller.close()
