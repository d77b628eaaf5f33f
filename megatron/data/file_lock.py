"""An exclusive advisory file lock for builders that several ranks may run at once (dataset index caches, the
dataset helpers' compile). Below both megatron/data/dataset_utils.py and megatron/data/helpers.py."""
from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on `path` (created if needed); a no-op where the filesystem has no flock support.

    Without the lock, concurrent builders still produce correct files (the contents are deterministic and every
    file is renamed into place atomically); the lock only avoids doing the work twice.
    """
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
