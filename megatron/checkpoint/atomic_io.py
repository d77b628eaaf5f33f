"""Atomic file writes for checkpoints and converters: write a temporary file beside the target (``<name>.tmp.<pid>``),
flush and fsync it, then rename it over the target, so a crash or a full disk never leaves a half-written checkpoint
or tracker file behind (a full disk is one line: `DiskFullError`, "no space left on the device holding ..."). A crash
can leave the temporary file; `remove_stale_temp_files` deletes those (checkpoint saves call it first).

Fault injection for the crash tests: with ``MEGATRON_FAULT_INJECT=<substring>@<n>`` the process SIGKILLs itself at
the n-th `fault_point` whose name contains the substring (points: ``mid-write:<file>`` with half the bytes on disk,
``before-rename:<file>``, ``after-rename:<file>``, plus any the caller adds); ``MEGATRON_FAULT_INJECT_LOG=<path>``
appends every point's name to a file; a ``!enospc`` suffix (``<substring>@<n>!enospc``) raises a full-disk OSError at
that point instead of the SIGKILL. Without these variables `fault_point` is a dictionary lookup.
"""
from __future__ import annotations

import errno
import io
import os
import re
import signal
from typing import Any

import torch

from megatron.errors import MegatronUserError


class DiskFullError(MegatronUserError, OSError):
    """A write failed because the device is full (or over quota); the target file was not published."""

FAULT_ENV = "MEGATRON_FAULT_INJECT"
FAULT_LOG_ENV = "MEGATRON_FAULT_INJECT_LOG"
_TMP_RE = re.compile(r"\.tmp\.\d+$")
_fault_hits = {"n": 0}


def fault_point(name: str) -> None:
    """Crash-test hook (see the module docstring); a no-op unless MEGATRON_FAULT_INJECT(_LOG) is set."""
    log = os.environ.get(FAULT_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(name + "\n")
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    spec, _, action = spec.partition("!")
    pattern, _, count = spec.rpartition("@")
    if pattern in name:
        _fault_hits["n"] += 1
        if _fault_hits["n"] == int(count):
            if action == "enospc":  # a full disk at this point instead of a crash
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.kill(os.getpid(), signal.SIGKILL)


def _fault_injection_on() -> bool:
    return bool(os.environ.get(FAULT_ENV) or os.environ.get(FAULT_LOG_ENV))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes_then_rename(path: str, write: Any, to_path: bool = False) -> None:
    """`write(file object)` (or `write(temp path)` with to_path) into the temp file, fsync, rename, fsync the folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    base = os.path.basename(path)
    try:
        if to_path:
            write(tmp)
        else:
            with open(tmp, "wb") as f:
                write(f)
        _fsync_file(tmp)
        fault_point(f"before-rename:{base}")
        os.replace(tmp, path)
        _fsync_dir(path)
        fault_point(f"after-rename:{base}")
    except (OSError, RuntimeError) as exc:
        if _disk_full(exc, os.path.dirname(path) or "."):
            raise DiskFullError(f"no space left on the device holding {os.path.dirname(path) or '.'} while writing "
                                f"{base}: free space or write somewhere else; {base} was not published (the previous "
                                "version, if any, is intact)") from None
        raise
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _free_bytes(folder: str) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def _disk_full(exc: BaseException, folder: str) -> bool:
    """ENOSPC / EDQUOT, or torch's writer failing (it reports no errno) on a device with (almost) no space left."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "write failed" in str(exc) and 0 <= _free_bytes(folder) < (1 << 20)


def _halves(data: bytes, base: str) -> Any:
    def write(f: Any) -> None:
        half = len(data) // 2
        f.write(data[:half])
        f.flush()
        fault_point(f"mid-write:{base}")
        f.write(data[half:])
    return write


def atomic_torch_save(obj: Any, path: str) -> None:
    """torch.save `obj` to `path` atomically (creating the parent folder)."""
    if _fault_injection_on():  # serialise first so that a crash can land with half the bytes written
        buf = io.BytesIO()
        torch.save(obj, buf)
        _write_bytes_then_rename(path, _halves(buf.getvalue(), os.path.basename(path)))
    else:
        _write_bytes_then_rename(path, lambda tmp: torch.save(obj, tmp), to_path=True)  # torch's fast file writer


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` atomically (flushed and fsynced before the rename)."""
    _write_bytes_then_rename(path, _halves(text.encode("utf-8"), os.path.basename(path)))


def is_temp_file(name: str) -> bool:
    """A temporary file of `atomic_torch_save` / `atomic_write_text` (``<name>.tmp.<pid>``)."""
    return bool(_TMP_RE.search(name))


def remove_stale_temp_files(root: str, max_depth: int = 3) -> list[str]:
    """Delete ``*.tmp.<pid>`` files left by crashed writes under `root` (call only while no write is in flight)."""
    removed: list[str] = []
    if not os.path.isdir(root):
        return removed
    base_depth = root.rstrip(os.sep).count(os.sep)
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath.count(os.sep) - base_depth >= max_depth:
            dirnames[:] = []
        for name in filenames:
            if is_temp_file(name):
                path = os.path.join(dirpath, name)
                try:
                    os.remove(path)
                    removed.append(path)
                except OSError:
                    pass
    return removed
