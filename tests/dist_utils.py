"""Run a function on N gloo processes on this CPU and collect what each rank returns.

Usage in a test::

    def _body(rank, world_size, x):          # module-level, so it pickles
        ...                                   # torch.distributed is initialised (gloo) here
        return some_picklable_result

    results = run_distributed(_body, world_size=2, args=(3,))   # list, one entry per rank

Exceptions in any rank are re-raised in the test with that rank's traceback.
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: Sequence, out_dir: str, threads: int,
            environ: dict) -> None:
    preloaded = sys.modules.get("tests.forkserver_preload")  # imported by the fork server, not under spawn
    os.environ.clear()  # the parent's environment as it is now (the fork server's is the one it started with)
    os.environ.update(preloaded.SET_BY_IMPORTS if preloaded is not None else {})
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    for fd, stream in ((1, "out"), (2, "err")):  # a fork server's stdout/stderr are those it started with
        log = os.open(os.path.join(out_dir, f"rank{rank}.{stream}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, fd)
        os.close(log)
    torch.set_num_threads(threads)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        if dist.is_initialized():
            try:
                dist.barrier()
            except Exception:
                pass
            dist.destroy_process_group()


def _start_method() -> str:
    """'forkserver' with torch, torch._dynamo and megatron's training stack imported once in the server
    (tests/forkserver_preload.py): each worker is a fork of a fresh interpreter that already imported them (~4.5 CPU s
    saved per training worker against 'spawn', which imports them again in every worker). The worker still starts
    from a clean interpreter (the server only imported modules, never ran training code) and gets the parent's
    current environment and working directory; its stdout/stderr go to files that the parent prints afterwards (the
    server's are those of the test that started it). RUN_DISTRIBUTED_START=spawn chooses spawn."""
    method = os.environ.get("RUN_DISTRIBUTED_START", "forkserver")
    if method == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(["tests.forkserver_preload"])
    return method


def _replay_output(out_dir: str, world_size: int) -> None:
    """What each rank printed, onto this process's stdout/stderr (where the test's output capture sees it)."""
    for rank in range(world_size):
        for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
            path = os.path.join(out_dir, f"rank{rank}.{name}")
            text = open(path, errors="replace").read() if os.path.exists(path) else ""
            if text:
                stream.write(f"--- rank {rank} std{name} ---\n{text}")
                stream.flush()


def run_distributed(fn: Callable, world_size: int, args: Sequence = (), threads: int = 1) -> list[Any]:
    """Start `world_size` gloo processes running `fn(rank, world_size, *args)`; return their results by rank."""
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(
                _worker,
                args=(world_size, port, fn, tuple(args), out_dir, threads, dict(os.environ)),
                nprocs=world_size,
                join=True,
                start_method=_start_method(),
            )
        finally:
            _replay_output(out_dir, world_size)
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} wrote no result")
            payload = torch.load(path, weights_only=False)
            if not payload["ok"]:
                raise RuntimeError(f"rank {rank} failed:\n{payload['error']}")
            results.append(payload["result"])
    return results
