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
from typing import Any, Callable, Optional

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


def _write_bytes_then_rename(path: str, write: Any, to_path: bool = False,
                             size: Optional[Callable[[], int]] = None) -> None:
    """`write(file object)` (or `write(temp path)` with to_path) into the temp file, fsync, rename, fsync the folder;
    `size()`: the bytes the write needs (named by a full disk's one line; called only then)."""
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
        folder = os.path.dirname(path) or "."
        if is_disk_full(exc, folder):
            note = _space_note(size() if size else None, folder)
            raise DiskFullError(f"no space left on the device holding {folder} while writing {base}{note}: free "
                                f"space or write somewhere else; {base} was not published (the previous version, if "
                                "any, is intact)") from None
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


def is_disk_full(exc: BaseException, folder: str) -> bool:
    """ENOSPC / EDQUOT, or a RuntimeError of torch's own file writer on a device with (almost) no space left: it
    reports no errno, and its words vary ("file write failed", "unexpected pos <n> vs <m>", "basic_ios::clear:
    iostream error" on a full device), so the free space decides."""
    if isinstance(exc, DiskFullError):
        return True
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, RuntimeError) and 0 <= _free_bytes(folder) < (1 << 20)


def _human(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _space_note(size: Optional[int], folder: str) -> str:
    """" (needs about 1.2 GiB; 3.0 MiB free)": what the write needed and what is left, as far as known."""
    free = _free_bytes(folder)
    parts = ([f"needs about {_human(size)}"] if size else []) + ([f"{_human(free)} free"] if free >= 0 else [])
    return f" ({'; '.join(parts)})" if parts else ""


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensor storages in `obj` (nested dicts, lists, tuples; each storage once): about what torch.save
    writes."""
    seen, total, stack = set(), 0, [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


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
        data = buf.getvalue()
        _write_bytes_then_rename(path, _halves(data, os.path.basename(path)), size=lambda: len(data))
    else:  # torch's fast file writer; on a full disk the one line names about how much the save needs
        _write_bytes_then_rename(path, lambda tmp: torch.save(obj, tmp), to_path=True, size=lambda: tensor_bytes(obj))


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` atomically (flushed and fsynced before the rename)."""
    data = text.encode("utf-8")
    _write_bytes_then_rename(path, _halves(data, os.path.basename(path)), size=lambda: len(data))


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
