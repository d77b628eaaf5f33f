"""Atomic file writes for checkpoints and converters: write a temporary file beside the target, then rename it over
the target, so a crash or a full disk never leaves a half-written checkpoint or tracker file behind."""
from __future__ import annotations

import os
from typing import Any

import torch


def atomic_torch_save(obj: Any, path: str) -> None:
    """torch.save `obj` to `path` atomically (creating the parent folder)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` atomically (flushed and fsynced before the rename)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
