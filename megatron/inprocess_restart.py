"""--inprocess-restart: when any rank raises during pretrain(), every rank restarts the run inside its own process.

Megatron-LM's flag, without its nvidia-resiliency-ext wrapper (not installable here); how it works, on gloo and NCCL:

1. A rank whose run raised prints one line (``in-process restart 1: rank 1 of 2 failed during training iteration 7:
   RuntimeError: ...``), tears its run down (model-parallel groups, the process group, Megatron's globals) and drops
   every reference to it, so that its sockets close: peers blocked in a collective with it fail at once (gloo
   "Connection closed by peer") instead of at the time-out, and restart the same way.
2. The ranks meet at a barrier on a store that outlives the process groups (rank 0 hosts a TCPStore at
   MASTER_PORT + 1, as Megatron's wrapper does; --inprocess-barrier-timeout) and start the next attempt with that
   store under the prefix ``megatron/inprocess/<n>/`` as the rendezvous of the new process group.
3. pretrain() runs again from the top: with --load it loads the latest checkpoint and the curve continues exactly,
   as after a requeue.

A rank that finished waits at a completion barrier (--inprocess-completion-timeout) and restarts with the others if
one of them failed at the very end. Not restarted: MegatronUserError (bad flags or input fail again), SystemExit,
KeyboardInterrupt; after --inprocess-max-iterations restarts the exception propagates. A hung rank is found by the
process groups' time-out (--distributed-timeout-minutes): its peers restart and then stop at the barrier's time-out,
since the hung rank never arrives (torchrun --max-restarts handles that). Megatron's monitor-process flags
(heartbeats, soft/hard time-outs, ...) configure nvidia-resiliency-ext and are refused at start-up.
"""
from __future__ import annotations

import gc
import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from megatron import initialize, peer_failure
from megatron.checkpoint import async_save
from megatron.errors import MegatronUserError
from megatron.launcher import detect_launcher_env

T = TypeVar("T")
_PREFIX = "megatron/inprocess/"
_POLL_S = 0.05  # how often a rank waiting at the completion barrier looks at the store


class InProcessRestartError(MegatronUserError, RuntimeError):
    """The in-process restart could not go on (a rank did not arrive at the barrier in time, ...)."""


class InProcessRestart:
    """Runs pretrain's attempts (`run`); an attempt `arm`s it once the flags are parsed."""

    def __init__(self) -> None:
        self.settings: Any = None
        self.attempt = 0
        self.store: Any = None
        self.world = 1

    def arm(self, settings: Any) -> None:
        """Called by each attempt after start-up with the run's Settings: remembers them and, on the first attempt
        of a multi-process run with --inprocess-restart, starts the store that outlives the process groups."""
        self.settings = settings
        if not settings.value("inprocess_restart"):
            return
        if settings.value("deepspeed"):
            raise InProcessRestartError("--inprocess-restart with --deepspeed: DeepSpeed keeps its own communication "
                                        "state, which a restart inside the process does not rebuild; drop one of "
                                        "them (torchrun --max-restarts restarts a DeepSpeed job from its checkpoint)")
        active = settings.value("inprocess_active_world_size")
        env = detect_launcher_env(os.environ)
        if active is not None and active != env.world_size:
            raise InProcessRestartError(f"--inprocess-active-world-size {active}: warm reserve ranks are not "
                                        f"supported; every rank of the job ({env.world_size}) takes part (drop the flag)")
        self.world = env.world_size
        if self.store is None and self.world > 1:
            if env.master_port is None:
                raise InProcessRestartError("--inprocess-restart with several ranks needs MASTER_PORT (torchrun and "
                                            "srun set it): its store listens at MASTER_PORT + 1")
            self.store = dist.TCPStore(env.master_addr, env.master_port + 1, self.world, is_master=env.rank == 0,
                                       timeout=self._timeout("inprocess_barrier_timeout"), wait_for_workers=False)

    @property
    def armed(self) -> bool:
        return self.settings is not None and bool(self.settings.value("inprocess_restart"))

    def _timeout(self, name: str) -> timedelta:
        return timedelta(seconds=float(self.settings.value(name)))

    def run(self, attempt: Callable[[], T]) -> T:
        """`attempt()` until it returns on every rank (restarting after failures, see the module doc)."""
        while True:
            try:
                result = attempt()
            except (MegatronUserError, SystemExit, KeyboardInterrupt):
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of the run restarts it (module doc)
                if not self._may_restart():
                    raise
                line = self._failure_line(exc)
            else:
                if not self.armed or self._all_finished():
                    return result
                line = f"rank {self._rank()} finished, but another rank failed at the end"
            self._restart(line)  # outside the except block: the exception and its frames are gone

    def _may_restart(self) -> bool:
        if not self.armed:
            return False
        limit = self.settings.value("inprocess_max_iterations")
        return limit is None or self.attempt < limit

    def _rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else detect_launcher_env(os.environ).rank

    def _failure_line(self, exc: BaseException) -> str:
        cause = " ".join(str(exc).split())[:200]
        return (f"rank {self._rank()} of {self.world} failed during {peer_failure.current_phase()}: "
                f"{type(exc).__name__}: {cause}")

    def _restart(self, line: str) -> None:
        self.attempt += 1
        print(f"in-process restart {self.attempt}: {line}; restarting every rank from the latest checkpoint",
              flush=True)
        abandoned = async_save.abandon()  # saves no collective can confirm now: never published
        if abandoned:
            print(f"in-process restart {self.attempt}: the asynchronous checkpoint save(s) of iteration(s) "
                  f"{', '.join(map(str, abandoned))} in flight are abandoned (not published)", flush=True)
        closed = self._close_peer_connections()
        initialize.destroy_megatron(unset_globals=True)
        gc.collect()
        if closed:
            print(f"in-process restart {self.attempt}: closed {closed} connection(s) of the old process groups",
                  flush=True)
        if self.settings.value("inprocess_empty_cuda_cache") and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.store is None:
            return
        key = f"{_PREFIX}{self.attempt - 1}/"
        self.store.set(key + "failed", "1")  # a rank waiting at the completion barrier joins the restart
        if self.store.add(key + "arrived", 1) == self.world:
            self.store.set(key + "go", "1")
        try:
            self.store.wait([key + "go"], self._timeout("inprocess_barrier_timeout"))
        except Exception as exc:  # noqa: BLE001 - torch raises its own store errors
            raise InProcessRestartError(
                f"in-process restart {self.attempt}: not every rank arrived at the barrier within "
                f"--inprocess-barrier-timeout {self.settings.value('inprocess_barrier_timeout'):g} s (a rank hung or "
                f"died: restart the job, e.g. torchrun --max-restarts) [{type(exc).__name__}]") from None
        initialize.use_rendezvous_store(dist.PrefixStore(f"{_PREFIX}{self.attempt}/", self.store))

    def _close_peer_connections(self) -> int:
        """Shut down this process's TCP connections to its peers except the stores' (MASTER_PORT, MASTER_PORT + 1),
        so that peers blocked in a collective with this rank fail now: destroying the process groups does not close
        gloo's connections while the library still holds the group (measured: the peers waited for the time-out).
        NCCL communicators are aborted. Returns the number of connections shut down."""
        for group in list(getattr(dist.distributed_c10d._world, "pg_map", {}) or {}):
            if dist.get_backend(group) == "nccl":
                dist.distributed_c10d._abort_process_group(group)
        env = detect_launcher_env(os.environ)
        keep = {p for p in (env.master_port, (env.master_port or 0) + 1) if p}
        closed = 0
        for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
            try:
                if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    continue
                sock = socket.socket(fileno=os.dup(int(name)))
            except OSError:
                continue
            with sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                    continue
                try:
                    ports = {sock.getsockname()[1], sock.getpeername()[1]}
                except OSError:  # listening or not connected
                    continue
                if ports & keep:
                    continue
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
                except OSError:
                    pass
        return closed

    def _all_finished(self) -> bool:
        """Completion barrier: True when every rank finished this attempt; False when one failed instead."""
        if self.store is None:
            return True
        key = f"{_PREFIX}{self.attempt}/"
        self.store.add(key + "finished", 1)
        deadline = time.monotonic() + float(self.settings.value("inprocess_completion_timeout"))
        while time.monotonic() < deadline:
            if self.store.check([key + "failed"]):
                return False
            if self.store.add(key + "finished", 0) >= self.world:
                self._linger(key)
                return True
            time.sleep(_POLL_S)
        raise InProcessRestartError(f"--inprocess-restart: not every rank finished within "
                                    f"--inprocess-completion-timeout {self.settings.value('inprocess_completion_timeout'):g} s")

    def _linger(self, key: str) -> None:
        """Rank 0 hosts the store: it leaves once every rank has seen the barrier pass (bounded)."""
        seen = self.store.add(key + "left", 1)
        if self._rank() != 0:
            return
        deadline = time.monotonic() + 10.0
        while seen < self.world and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            seen = self.store.add(key + "left", 0)
