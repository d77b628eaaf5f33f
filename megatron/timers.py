"""Megatron's named timers with log levels, cross-rank min/max reporting and tensorboard output.

Usage: `timers = Timers(log_level=2, log_option="minmax")`; `timers("forward-compute", log_level=2).start()`
... `.stop()`; `timers.log(["forward-compute"], normalizer=n)` (a collective: call it on every rank).
Timers above the configured level are no-ops. CUDA is synchronised only when it is in use.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

from megatron.core.rank_print import print_line

_SEP = "\n    "


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class _TimerBase:
    def __init__(self, name: str) -> None:
        self.name = name

    def start(self, barrier: bool = False) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def stop(self, barrier: bool = False) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def reset(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:  # pragma: no cover - interface
        raise NotImplementedError


class DummyTimer(_TimerBase):
    """Returned for timers above the configured log level: does nothing."""

    def __init__(self) -> None:
        super().__init__("dummy timer")

    def start(self, barrier: bool = False) -> None:
        return

    def stop(self, barrier: bool = False) -> None:
        return

    def reset(self) -> None:
        return

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        raise RuntimeError("dummy timer should not be used to calculate elapsed time")

    def active_time(self) -> float:
        return 0.0


class Timer(_TimerBase):
    """A wall-clock timer that accumulates between start/stop pairs (seconds)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._start_time = time.time()

    def start(self, barrier: bool = False) -> None:
        if self._started:
            raise RuntimeError(f"timer '{self.name}' has already been started")
        if barrier:
            _barrier()
        _sync()
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        if not self._started:
            raise RuntimeError(f"timer '{self.name}' is not started")
        if barrier:
            _barrier()
        _sync()
        elapsed = time.time() - self._start_time
        self._elapsed += elapsed
        self._active_time += elapsed
        self._started = False

    def reset(self) -> None:
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Accumulated seconds (a running timer is stopped, read and restarted)."""
        was_started = self._started
        if was_started:
            self.stop(barrier=barrier)
        value = self._elapsed
        if reset:
            self.reset()
        if was_started:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        return self._active_time


class Timers:
    """Group of named timers (Megatron's `Timers`)."""

    def __init__(self, log_level: int = 0, log_option: str = "minmax") -> None:
        if log_option not in ("max", "minmax", "all"):
            raise ValueError(f"--timing-log-option must be max, minmax or all (got {log_option!r})")
        self._log_level = log_level
        self._log_option = log_option
        self._timers: Dict[str, Timer] = {}
        self._log_levels: Dict[str, int] = {}
        self._dummy_timer = DummyTimer()
        self._max_log_level = 2

    def __call__(self, name: str, log_level: Optional[int] = None) -> _TimerBase:
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(
                    f"timer '{name}' was created with log level {self._log_levels[name]}, now asked for {log_level}"
                )
            return self._timers[name]
        if log_level is None:
            log_level = self._max_log_level
        if log_level > self._max_log_level:
            raise ValueError(f"timer log level {log_level} is larger than the maximum {self._max_log_level}")
        if log_level > self._log_level:
            return self._dummy_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    def _elapsed_all_ranks(self, names: List[str], reset: bool, barrier: bool) -> torch.Tensor:
        """[world_size, len(names)] elapsed seconds; zeros for timers a rank does not have."""
        if barrier:
            _barrier()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        world_size = torch.distributed.get_world_size() if distributed else 1
        local = torch.zeros(len(names), dtype=torch.float)
        for i, name in enumerate(names):
            if name in self._timers:
                local[i] = self._timers[name].elapsed(reset=reset)
        if world_size == 1:
            return local.unsqueeze(0)
        device = torch.device("cuda", torch.cuda.current_device()) if (
            torch.distributed.get_backend() == "nccl") else torch.device("cpu")
        local = local.to(device)
        gathered = [torch.zeros_like(local) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, local)
        return torch.stack(gathered).cpu()

    def _min_max(self, names: List[str], reset: bool, barrier: bool, normalizer: float) -> Dict[str, tuple]:
        all_times = self._elapsed_all_ranks(names, reset, barrier)
        result = {}
        for i, name in enumerate(names):
            column = all_times[:, i]
            column = column[column > 0.0]
            if column.numel() > 0:
                result[name] = (column.min().item() * 1000.0 / normalizer, column.max().item() * 1000.0 / normalizer)
        return result

    def get_log_string(self, names: List[str], normalizer: float = 1.0, reset: bool = True,
                       barrier: bool = False) -> Optional[str]:
        """The text `log` prints (a collective on all ranks); None if no timer has a value."""
        if normalizer <= 0.0:
            raise ValueError(f"timers normalizer must be positive (got {normalizer})")
        if self._log_option in ("max", "minmax"):
            values = self._min_max(names, reset, barrier, normalizer)
            if not values:
                return None
            out = "(min, max) time across ranks (ms):"
            for name, (lo, hi) in values.items():
                label = (name + " ").ljust(48, ".")
                value = f"{hi:.2f}" if self._log_option == "max" else f"({lo:.2f}, {hi:.2f})"
                out += f"{_SEP}{label}: {value}"
            return out
        all_times = self._elapsed_all_ranks(names, reset, barrier) * 1000.0 / normalizer
        out = "times across ranks (ms):"
        found = False
        for i, name in enumerate(names):
            header = False
            for rank in range(all_times.shape[0]):
                if all_times[rank, i] > 0:
                    found = True
                    if not header:
                        out += f"\n  {name}:"
                        header = True
                    out += f"\n     rank {rank:2d}: {all_times[rank, i].item():.2f}"
        return out if found else None

    def log(self, names: List[str], rank: Optional[int] = None, normalizer: float = 1.0, reset: bool = True,
            barrier: bool = False) -> None:
        """Print the timers on `rank` (default: the last rank). Every rank must call this."""
        text = self.get_log_string(names, normalizer=normalizer, reset=reset, barrier=barrier)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        world_size = torch.distributed.get_world_size() if distributed else 1
        my_rank = torch.distributed.get_rank() if distributed else 0
        if rank is None:
            rank = world_size - 1
        if rank == my_rank and text is not None:
            print_line(text)

    def write(self, names: List[str], writer, iteration: int, normalizer: float = 1.0, reset: bool = False,
              barrier: bool = False) -> None:
        """Write the max-over-ranks time of each timer to tensorboard as '<name>-time' (collective)."""
        if normalizer <= 0.0:
            raise ValueError(f"timers normalizer must be positive (got {normalizer})")
        values = self._min_max(names, reset, barrier, normalizer)
        if writer is not None:
            for name, (_lo, hi) in values.items():
                writer.add_scalar(name + "-time", hi, iteration)
