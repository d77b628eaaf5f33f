"""A dead or hung rank must not hang the job: the survivors name it in one line and exit non-zero.

When a process of a distributed run dies (kill -9, out of memory, a lost node), the others fail in their next
collective (gloo: "Connection reset by peer" at once; a hung peer: a time-out after --distributed-timeout-minutes,
which initialize passes to every process group). `exit_on_user_error` hands such an error to `exit_on_peer_failure`,
which prints

    error: rank 1 of 4 stopped during training iteration 6: rank 2 died (process 4711 on node-3 is gone) ...

and exits with code 1. How: the survivor marks itself failed in the rendezvous store, closes its own connections
(destroying its process groups, so that peers blocked on it fail now rather than at their time-out), then names the
peers on its host whose process is gone without having marked themselves (each process records ``host pid`` in the
store at start-up, `register`), or else, after a short wait, the peers that never marked themselves (hung, or on a
lost node). Rank 0 of a launch without torchrun's agent store hosts the store: it stays until the others are done
(at most 10 s). Without a store (its host is gone) the line says so.

``MEGATRON_DISTRIBUTED_TIMEOUT_SECONDS`` overrides --distributed-timeout-minutes (whole minutes, as in Megatron):
for tests only, to exercise the time-out path in seconds.
"""
from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from megatron import optional

TIMEOUT_ENV = "MEGATRON_DISTRIBUTED_TIMEOUT_SECONDS"
_KEY = "megatron/peer/"
_FAILED = "megatron/failed/"
_DONE = "megatron/diagnosed/"
_MARKERS = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out waiting",
            "socket timeout", "connection refused", "communicator was aborted", "watchdog caught collective")
_phase = {"what": "start-up"}


def distributed_timeout(minutes: int) -> timedelta:
    """The process-group time-out: --distributed-timeout-minutes, or MEGATRON_DISTRIBUTED_TIMEOUT_SECONDS (tests)."""
    seconds = os.environ.get(TIMEOUT_ENV)
    if seconds:
        return timedelta(seconds=float(seconds))
    return timedelta(minutes=minutes)


def note_phase(what: str) -> None:
    """Record what this process is doing (e.g. ``training iteration 6``) for the one-line report."""
    _phase["what"] = what


def current_phase() -> str:
    """What this process said it is doing (`note_phase`)."""
    return _phase["what"]


def register(rank: int, store: Any = None) -> None:
    """Record this process's host and pid in the (default) rendezvous store; one set, failures here are not fatal."""
    try:
        if store is None:
            store = optional.torch_distributed().distributed_c10d._get_default_store()
        store.set(f"{_KEY}{rank}", f"{socket.gethostname()} {os.getpid()}")
    except Exception:  # noqa: BLE001 - diagnosis is best effort; training must not depend on it
        pass


def is_peer_failure(exc: BaseException) -> bool:
    """A communication error of torch.distributed (peer gone, time-out), looking through the exception chain."""
    dist = optional.torch_distributed()
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, getattr(dist, "DistError", ())):
            return True
        text = str(exc).lower()
        if isinstance(exc, (RuntimeError, OSError)) and any(m in text for m in _MARKERS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a killed child its launcher has not reaped yet
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _read_peers(store: Any, others: list[int]) -> dict[int, tuple[str, int]]:
    peers = {}
    for r, value in zip(others, store.multi_get([f"{_KEY}{r}" for r in others])):
        peer_host, pid = bytes(value).decode().split()
        peers[r] = (peer_host, int(pid))
    return peers


def find_lost_ranks(store: Any, rank: int, world_size: int, wait_s: float = 10.0) -> tuple[list[str], bool]:
    """Descriptions of the peers that are gone (dead on this host, or silent after `wait_s`); (.., store reachable)."""
    others = [r for r in range(world_size) if r != rank]
    host = socket.gethostname()
    try:
        peers = _read_peers(store, others)
    except Exception:  # noqa: BLE001 - the store's host is gone (or the peers never registered)
        return [], False
    end = time.monotonic() + wait_s
    last, stable_since = None, time.monotonic()
    while True:
        try:  # a survivor marks itself before it exits: a process that is gone unmarked died
            silent = [r for r in others if not store.check([f"{_FAILED}{r}"])]
        except Exception:  # noqa: BLE001
            return [], False
        dead = [f"rank {r} died (process {peers[r][1]} on {host} is gone)" for r in silent
                if peers[r][0] == host and _process_gone(peers[r][1])]
        if dead:
            return dead, True
        now = time.monotonic()
        if silent != last:
            last, stable_since = silent, now
        if not silent:
            return [], True
        if now >= end or now - stable_since >= 3.0:
            return [f"rank {r} stopped responding (process {peers[r][1]} on {peers[r][0]}: hung, or its node is "
                    "lost)" for r in silent], True
        time.sleep(0.2)


def linger_while_others_diagnose(store: Any, rank: int, world_size: int, wait_s: float = 10.0) -> None:
    """Rank 0 of a launch without an agent store hosts the store: stay while the other survivors diagnose (those
    that marked themselves failed and are not done; ranks that marked nothing get 2 s to start), at most `wait_s`."""
    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    others = list(range(1, world_size))
    start = time.monotonic()
    try:
        peers = _read_peers(store, others)
        host = socket.gethostname()
        while time.monotonic() - start < wait_s:
            failed = {r for r in others if store.check([f"{_FAILED}{r}"])}
            busy = [r for r in failed if not store.check([f"{_DONE}{r}"])]
            unmarked = [r for r in others
                        if r not in failed and not (peers[r][0] == host and _process_gone(peers[r][1]))]
            if not busy and (not unmarked or time.monotonic() - start > 2.0):
                return
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - best effort
        return


def _close_connections() -> None:
    """Destroy the process groups (closes this rank's sockets, so that peers blocked on it fail at once instead of
    at their time-out); in a thread, given 5 s, as nothing here may block."""
    dist = optional.torch_distributed()
    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass

    thread = threading.Thread(target=destroy, daemon=True)
    thread.start()
    thread.join(5.0)


def store_answers(store: Any, key: str, wait_s: float = 5.0) -> bool:
    """Whether the store answers (has `key`) within `wait_s`. Asked in a thread: towards a host that is unreachable
    (its link down) a store read can block in recv() past the store's own time-out."""
    answer: list[bool] = []

    def ask() -> None:
        try:
            answer.append(bool(store.check([key])))
        except Exception:  # noqa: BLE001 - no answer
            pass

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(wait_s)
    return bool(answer and answer[0])


def describe(exc: BaseException) -> str:
    """Mark this rank failed, close its connections, find the lost rank; return the one line (see the module doc)."""
    dist = optional.torch_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    lost, store_ok, store = [], False, None
    try:
        store = dist.distributed_c10d._get_default_store()  # kept referenced: on rank 0 of a direct launch it is the store's server
        store.set_timeout(timedelta(seconds=5))
        store.set(f"{_FAILED}{rank}", "1")
    except Exception:  # noqa: BLE001 - the store's host is gone
        store = None
    _close_connections()
    if store is not None and not store_answers(store, f"{_FAILED}{rank}"):
        store = None  # (a set is one-way: it "succeeds" towards a host this node can no longer reach)
    if store is not None:
        lost, store_ok = find_lost_ranks(store, rank, world)
        if store_ok:
            try:
                store.set(f"{_DONE}{rank}", "1")
            except Exception:  # noqa: BLE001
                pass
            linger_while_others_diagnose(store, rank, world)
    if lost:
        who = "; ".join(lost)
    elif not store_ok:
        addr = os.environ.get("MASTER_ADDR")
        where = f" at {addr}:{os.environ.get('MASTER_PORT', '?')}" if addr else ""
        who = (f"the rendezvous store{where} does not answer either (rank 0 or the launcher that hosts it is gone, "
               "or this node lost its network)")
    else:
        who = "every other rank reports the same failure (a network problem?)"
    cause = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", " ".join(str(exc).split()))  # gloo's source path
    cause = cause.split(". ")[0][:160]
    return (f"rank {rank} of {world} stopped during {_phase['what']}: {who} [{type(exc).__name__}: {cause}]; "
            "exiting. Restart from the last checkpoint (--load; torchrun --max-restarts N does it automatically)")


def exit_on_peer_failure(exc: BaseException) -> None:
    """Print the one line to stderr and exit 1 at once (no further teardown)."""
    line = describe(exc)
    sys.stdout.flush()
    print(f"error: {line}", file=sys.stderr, flush=True)
    os._exit(1)


def peer_failure_in_run(exc: BaseException) -> bool:
    """True when `exc` is a communication failure of an initialised multi-process run (exit via the one line)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    return is_peer_failure(exc)
