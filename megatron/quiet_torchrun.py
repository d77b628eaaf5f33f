"""`python -m megatron.quiet_torchrun [torchrun flags] script.py [flags]`: torchrun for the example scripts, with three
differences that matter to a user (everything else is torchrun's, flags included):

- A user error (bad flag, wrong file: `error: ...` and exit code 1 from `megatron.errors.exit_on_user_error`) prints
  once, from rank 0, and the launcher exits 1 without torch elastic's crash report (a traceback plus a failure table,
  about 35 lines, that buries the one line that matters). How: the workers get MEGATRON_USER_ERROR_DIR; on a user
  error rank 0 prints its line, every rank writes its line to `rank<N>.txt` there (other ranks print nothing). When
  the job fails, every failed worker left such a file or was stopped by the agent's SIGTERM after the first failure,
  this launcher prints the lowest rank's line if rank 0 did not print one, and exits 1. Any other failure (a crash, a
  signal) keeps torchrun's full report and exit code. Without this launcher (plain torchrun) every rank prints its
  line.
- A SIGTERM (a scheduler's preemption, `kill`, `docker stop`) is forwarded to every worker's process group and waited
  for without torchrun's 30 s kill (`--shutdown-timeout`): workers under `--exit-signal-handler` finish their step,
  save and exit 0, and then so does the launcher. A worker that does not exit 0 makes it exit 143 with one line
  naming the exit codes (and no restart under --max-restarts). A second signal (SIGINT, SIGKILL) still ends it.
- A `--master-port` already in use on this machine is one line naming it and the fix instead of torch's EADDRINUSE
  traceback. (Without --master-port on one node torchrun itself picks a free port.)
- A rendezvous that does not complete within `--rdzv-conf join_timeout` (torch's default 600 s; the example SLURM
  scripts pass RDZV_TIMEOUT) is one line naming the endpoint, the nodes that arrived and, under SLURM, exactly the
  job's nodes that did not, instead of torch's bare RendezvousTimeoutError traceback. torch does not say who arrived:
  its c10d rendezvous keeps the participants in its store (key ``torch.rendezvous.<id>``), but a node removes itself
  from them when its own wait ends, so `RendezvousWatch` reads that state every half second while the rendezvous
  waits (a client of the same store, stopped once the rendezvous completes). If it saw nothing (it could not reach
  the store) the line names this node and the job's other nodes as candidates, as before.
"""
from __future__ import annotations

import datetime as datetime_module
import errno
import io
import logging
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
from base64 import b64decode
from datetime import timedelta
from typing import Any, Optional

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import parse_args, parse_min_max_nnodes, run

from megatron.launcher import parse_slurm_nodelist

ERROR_DIR_ENV = "MEGATRON_USER_ERROR_DIR"
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class _DropUserErrorExits(logging.Filter):
    """Hide the elastic agent's 'failed (exitcode: 1)' and 'closing signal SIGTERM' records (a crash still gets its
    failure table with the exit codes), the asterisk rules around its OMP_NUM_THREADS note and, when this launcher
    forwards a SIGTERM itself, the agent's 'death signal, shutting down workers' record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "*****" in message:  # the rules around torchrun's OMP_NUM_THREADS note: keep its one line of text
            record.msg, record.args = " ".join(line.strip() for line in message.splitlines() if line.strip(" *")), ()
            return bool(record.msg)
        return not ("(exitcode: 1)" in message or "closing signal SIGTERM" in message
                    or "death signal, shutting down workers" in message)


def _user_errors(folder: str) -> dict[int, str]:
    out = {}
    for name in os.listdir(folder):
        if name.startswith("rank") and name.endswith(".txt"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                out[int(name[4:-4])] = f.read().strip()
    return out


def only_user_errors(failures: dict[int, Any], errors: dict[int, str]) -> bool:
    """True when every failed rank either left a user-error line or was stopped by the agent's SIGTERM (what torch
    elastic does to the other workers after the first failure), and at least one left a line."""
    stopped = -int(signal.SIGTERM)
    return bool(errors) and bool(failures) and any(rank in errors for rank in failures) and all(
        rank in errors or getattr(failure, "exitcode", None) == stopped for rank, failure in failures.items())


def _worker_pids() -> list[int]:
    """This process's children that lead their own session: the workers torch elastic started (Linux /proc)."""
    me, pids = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()  # state ppid pgrp session ...
        except OSError:
            continue
        if len(fields) > 3 and int(fields[1]) == me and int(fields[3]) == int(name):
            pids.append(int(name))
    return pids


def _exit_code(pid: int) -> Optional[int]:
    """Wait for child `pid` to end without reaping it (torch's Popen still collects it); Popen-style code."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # already reaped by the agent
        return None
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class SigtermForwarder:
    """The launcher's SIGTERM handler (instead of torch elastic's): forward to the workers, wait for all of them;
    return to the agent when every one exited 0 (it then finishes normally), else stop it as torch would."""

    def __init__(self) -> None:
        self.codes: Optional[dict[int, Optional[int]]] = None
        self.previous: Any = signal.SIG_DFL  # the handler to restore when the launcher returns

    def __call__(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal API
        if self.codes is not None:  # a second SIGTERM while the workers save: already forwarded
            return
        pids = _worker_pids()
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        self.codes = {pid: _exit_code(pid) for pid in pids}
        if not pids or any(code != 0 for code in self.codes.values()):
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    def summary(self) -> str:
        """One line: what the workers did with the forwarded SIGTERM."""
        codes = self.codes or {}
        if not codes:
            return "error: SIGTERM before the workers started (or between restarts): nothing to save; stopped"
        listed = ", ".join(f"{pid}: {code}" for pid, code in sorted(codes.items()))
        return (f"error: SIGTERM forwarded to the {len(codes)} workers of this node; exit codes {{{listed}}} "
                "(-15: stopped by the signal; pass --exit-signal-handler to save and exit 0)")


def take_over_sigterm(args: Any) -> Optional[SigtermForwarder]:
    """Install SigtermForwarder when torchrun would handle SIGTERM itself (its --signals-to-handle) on Linux, and
    take SIGTERM out of torchrun's list; None where this is not possible (no /proc, SIGTERM the only signal)."""
    names = [name.strip() for name in args.signals_to_handle.split(",") if name.strip()]
    if "SIGTERM" not in names or len(names) == 1 or not os.path.isdir("/proc") or not hasattr(os, "waitid"):
        return None
    args.signals_to_handle = ",".join(name for name in names if name != "SIGTERM")
    forwarder = SigtermForwarder()
    forwarder.previous = signal.signal(signal.SIGTERM, forwarder)
    return forwarder


def port_in_use(port: int) -> bool:
    """True when something on this machine already listens on TCP `port` (a bind like the rendezvous store's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def port_clash_line(port: int) -> str:
    """The one line for a --master-port that another process holds."""
    return (f"error: --master-port {port} (MASTER_PORT in the example scripts) is already in use on this machine, "
            "probably by another run: pick another port, or leave it unset on one node for a free one")


class _Record:
    """What torch's rendezvous state and node descriptions unpickle to here: their fields, nothing callable."""


class _StateUnpickler(pickle.Unpickler):
    """Unpickles torch's c10d rendezvous state (its dataclasses as `_Record`s, its datetimes) and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.elastic.rendezvous.dynamic_rendezvous":
            return _Record
        if module == "datetime" and name in ("datetime", "timezone", "timedelta"):
            return getattr(datetime_module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a rendezvous state")


def rendezvous_nodes(value: bytes) -> Optional[tuple[int, bool, list[str]]]:
    """(round, complete, the participants' addresses) from the value torch's c10d rendezvous backend keeps under
    ``torch.rendezvous.<id>`` (base64 of a pickled state); None for the empty sentinel or anything unreadable."""
    try:
        state = _StateUnpickler(io.BytesIO(b64decode(value, validate=True))).load()
        return int(state.round), bool(state.complete), sorted(node.addr for node in state.participants)
    except Exception:  # noqa: BLE001 - torch's private format may change: then the watch has seen nothing
        return None


class RendezvousWatch:
    """The nodes that joined the current round of torchrun's c10d rendezvous at `endpoint`, as read from its store
    every `interval_s` by a daemon thread until the round completes or `stop()` (torch removes a node that gave up
    waiting from the state, so a read after the time-out would miss it)."""

    def __init__(self, endpoint: str, run_id: str, wait_s: float, interval_s: float = 0.5) -> None:
        self.host, self.port = parse_rendezvous_endpoint(endpoint, default_port=29400)
        self.key, self.wait_s, self.interval_s = f"torch.rendezvous.{run_id}", wait_s, interval_s
        self.round, self.seen = -1, set()  # the newest round read and every participant seen in it
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rendezvous-watch", daemon=True)

    def start(self) -> RendezvousWatch:
        """Start reading in the background; returns self."""
        self._thread.start()
        return self

    def stop(self) -> list[str]:
        """Stop reading; the addresses of the nodes seen in the newest round (empty if none was read)."""
        self._stop.set()
        with self._lock:
            return sorted(self.seen)

    def _watch(self) -> None:
        try:  # the agent on the endpoint's node opens the store: wait for it as the agents do
            store = TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=self.wait_s),
                             wait_for_workers=False)
        except Exception:  # noqa: BLE001 - unreachable store: the time-out line then names candidates
            return
        while not self._stop.is_set():
            try:
                read = rendezvous_nodes(store.get(self.key)) if store.check([self.key]) else None
            except Exception:  # noqa: BLE001 - the store went away (its node gave up or is lost)
                return
            if read is not None:
                number, complete, nodes = read
                with self._lock:
                    if number > self.round:
                        self.round, self.seen = number, set()
                    if number == self.round:
                        self.seen.update(nodes)
                if complete:
                    return
            self._stop.wait(self.interval_s)


def _short(host: str) -> str:
    return host.split(".")[0]


def _arrival_text(arrived: list[str], here: str, nodelist: Optional[str], nnodes: str) -> str:
    """'2 of 3 nodes arrived (node01 (this node), node02); node03 never did (...)' from the watch's addresses."""
    minimum = parse_min_max_nnodes(nnodes)[0]
    shown = [f"{a} (this node)" if _short(a) == _short(here) else a for a in arrived]
    text = f"{len(arrived)} of {minimum} node{'s' if minimum > 1 else ''} arrived ({', '.join(shown)})"
    hosts = parse_slurm_nodelist(nodelist) if nodelist else []
    came = {_short(a) for a in arrived}
    missing = [h for h in hosts if _short(h) not in came]
    if not missing or not came <= {_short(h) for h in hosts}:  # not SLURM, or torch's addresses are not its names
        return text + "; the missing ones are"
    return (f"{text}; {', '.join(missing)} (SLURM_JOB_NODELIST) never did: "
            f"{'they are' if len(missing) > 1 else 'it is'}")


def rendezvous_timeout_line(args: Any, env: Optional[dict] = None, arrived: Optional[list[str]] = None) -> str:
    """The one line for torchrun's rendezvous timing out: endpoint, wait, node count and, from the addresses a
    RendezvousWatch saw (`arrived`), the nodes that came and the job's nodes that did not; without them (or when
    they do not include this node, so the watch missed the round) this node and the job's other nodes."""
    env = dict(os.environ) if env is None else env
    conf = dict(item.split("=", 1) for item in (args.rdzv_conf or "").split(",") if "=" in item)
    wait = conf.get("join_timeout", "600")
    here = args.local_addr or socket.gethostname()
    endpoint = args.rdzv_endpoint or "localhost"
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if arrived and any(_short(a) == _short(here) for a in arrived):
        who = (f"{_arrival_text(arrived, here, nodelist, args.nnodes)} lost, did not start torchrun, or cannot "
               f"reach {endpoint}")
    else:
        others = [h for h in parse_slurm_nodelist(nodelist) if _short(h) != _short(here)] if nodelist else []
        candidates = (f"; the job's other node{'s' if len(others) > 1 else ''} (SLURM_JOB_NODELIST): "
                      f"{', '.join(others)}" if others else "")
        who = (f"not every node arrived (this node: {here}{candidates}); a missing node is lost, its torchrun did "
               f"not start, or it cannot reach {endpoint}")
    return (f"error: torchrun's rendezvous at {endpoint} (id {args.rdzv_id}) did not complete in {wait} s: "
            f"--nnodes {args.nnodes} and {who}. Requeue or resubmit the job (it resumes from --load); RDZV_TIMEOUT "
            "in examples/slurm (torchrun --rdzv-conf join_timeout=S) sets this wait")


def watch_rendezvous(args: Any) -> Optional[RendezvousWatch]:
    """A started RendezvousWatch for a c10d rendezvous of more than one node at an explicit endpoint, else None."""
    if args.rdzv_backend != "c10d" or args.standalone or not args.rdzv_endpoint:
        return None
    if parse_min_max_nnodes(args.nnodes)[1] < 2:
        return None
    conf = dict(item.split("=", 1) for item in (args.rdzv_conf or "").split(",") if "=" in item)
    return RendezvousWatch(args.rdzv_endpoint, args.rdzv_id, float(conf.get("join_timeout", "600"))).start()


_QUIET = _DropUserErrorExits()


def _quiet_elastic_logs() -> None:
    for name in ("", "torch.distributed.elastic", "torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.run", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_QUIET)  # addFilter ignores a filter already there
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(_QUIET)


def main(argv: Optional[list[str]] = None) -> int:
    """Run torchrun with the differences above; returns the exit code."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    static_master = args.rdzv_backend == "static" and not args.standalone and not args.rdzv_endpoint
    if static_master and args.master_port is not None and args.node_rank == 0 and port_in_use(args.master_port):
        print(port_clash_line(args.master_port), file=sys.stderr, flush=True)
        return 1
    folder = tempfile.mkdtemp(prefix="megatron-user-errors-")
    os.environ[ERROR_DIR_ENV] = folder  # inherited by the workers
    _quiet_elastic_logs()
    forwarder = take_over_sigterm(args)
    watch = watch_rendezvous(args)
    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        errors = _user_errors(folder)
        if only_user_errors(exc.failures, errors):
            if 0 not in errors:  # rank 0 printed nothing: say the lowest rank's line once
                print(errors[min(errors)], file=sys.stderr, flush=True)
            return 1
        raise
    except RendezvousTimeoutError:
        print(rendezvous_timeout_line(args, arrived=watch.stop() if watch else None), file=sys.stderr, flush=True)
        return 1
    except SignalException:
        if forwarder is None or forwarder.codes is None:
            raise
        print(forwarder.summary(), file=sys.stderr, flush=True)
        return SIGTERM_EXIT_CODE
    except RuntimeError as exc:  # torch's DistNetworkError when the rendezvous store cannot listen
        if "EADDRINUSE" in str(exc) and static_master:
            print(port_clash_line(args.master_port), file=sys.stderr, flush=True)
            return 1
        raise
    finally:
        if watch is not None:
            watch.stop()
        if forwarder is not None:
            signal.signal(signal.SIGTERM, forwarder.previous)
        os.environ.pop(ERROR_DIR_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
