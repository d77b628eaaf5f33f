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
  scripts pass RDZV_TIMEOUT) is one line naming the endpoint and the nodes that may be missing instead of torch's
  bare RendezvousTimeoutError traceback (torch does not say which nodes arrived: the line names this node and, under
  SLURM, the job's other nodes).
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any, Optional

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.run import parse_args, run

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


def rendezvous_timeout_line(args: Any, env: Optional[dict] = None) -> str:
    """The one line for torchrun's rendezvous timing out: endpoint, wait, node count, this node and the candidates."""
    env = dict(os.environ) if env is None else env
    conf = dict(item.split("=", 1) for item in (args.rdzv_conf or "").split(",") if "=" in item)
    wait = conf.get("join_timeout", "600")
    here = socket.gethostname()
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    others = [h for h in parse_slurm_nodelist(nodelist) if h.split(".")[0] != here.split(".")[0]] if nodelist else []
    candidates = (f"; the job's other node{'s' if len(others) > 1 else ''} (SLURM_JOB_NODELIST): {', '.join(others)}"
                  if others else "")
    return (f"error: torchrun's rendezvous at {args.rdzv_endpoint or 'localhost'} (id {args.rdzv_id}) did not "
            f"complete in {wait} s: --nnodes {args.nnodes} and not every node arrived (this node: {here}"
            f"{candidates}); a missing node is lost, its torchrun did not start, or it cannot reach "
            f"{args.rdzv_endpoint or 'localhost'}. Requeue or resubmit the job (it resumes from --load); "
            "RDZV_TIMEOUT in examples/slurm (torchrun --rdzv-conf join_timeout=S) sets this wait")


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
        print(rendezvous_timeout_line(args), file=sys.stderr, flush=True)
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
        if forwarder is not None:
            signal.signal(signal.SIGTERM, forwarder.previous)
        os.environ.pop(ERROR_DIR_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
