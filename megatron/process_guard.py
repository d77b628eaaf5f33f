"""Process-level guards for a training job's processes (no torch; Linux only, a no-op elsewhere).

- `exit_with_launcher_agent()`: a worker started by torchrun dies with its agent (PR_SET_PDEATHSIG). Without it a
  `kill -9` of the agent leaves its workers training and writing into --save, unsupervised.
- `dataloader_worker_init()`: the data-loader workers' `worker_init_fn`. A scheduler's SIGTERM reaches every process
  (torchrun forwards it to each worker's process group; SLURM signals the whole step); torch's own worker handler
  dies on a SIGTERM from anyone but its trainer, and the trainer then fails its next batch with "DataLoader worker is
  killed by signal: Terminated" instead of saving under --exit-signal-handler. The workers therefore leave SIGTERM
  and SIGINT to the trainer: a thread swallows them, except a SIGTERM sent by the trainer itself (how torch and
  multiprocessing stop their workers), which still ends the worker with exit code 0 as torch's handler does.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Mapping, Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_TRAINER_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def launched_by_torchrun(env: Optional[Mapping[str, str]] = None) -> bool:
    """True in a worker process that torchrun's elastic agent started (it sets TORCHELASTIC_RUN_ID)."""
    env = os.environ if env is None else env
    return bool(env.get("TORCHELASTIC_RUN_ID"))


def exit_with_launcher_agent(env: Optional[Mapping[str, str]] = None) -> bool:
    """Under torchrun on Linux, have the kernel SIGKILL this process when its agent (the parent) dies; returns
    whether that was armed. (An agent that died before this call is not detected here: a parent pid of 1 is also
    torchrun as a container's first process. Such a worker fails at once anyway: the rendezvous store lives in the
    agent.)"""
    if not sys.platform.startswith("linux") or not launched_by_torchrun(env):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no prctl in this libc: nothing to arm
        return False
    return True


def _swallow_trainer_signals(trainer_pid: int) -> None:
    """Wait for the blocked signals forever; a SIGTERM from the trainer ends the worker (exit code 0)."""
    while True:
        info = signal.sigwaitinfo(set(_TRAINER_SIGNALS))
        if info.si_signo == signal.SIGTERM and info.si_pid == trainer_pid:
            os._exit(0)


def dataloader_worker_init(worker_id: int) -> None:
    """`worker_init_fn` of the training data loaders: SIGTERM/SIGINT from anyone but the trainer are ignored (the
    trainer decides: --exit-signal-handler saves first); the trainer's own SIGTERM still stops the worker."""
    del worker_id
    if not hasattr(signal, "sigwaitinfo") or not hasattr(signal, "pthread_sigmask"):
        return  # macOS, Windows: torch's behaviour unchanged
    # Blocked in this (the worker's only) thread, so in every thread it starts later; one thread takes them.
    signal.pthread_sigmask(signal.SIG_BLOCK, set(_TRAINER_SIGNALS))
    threading.Thread(target=_swallow_trainer_signals, args=(os.getppid(),), name="trainer-signals",
                     daemon=True).start()
