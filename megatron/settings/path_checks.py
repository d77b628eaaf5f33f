"""Start-up checks of the folders the flags name (--save, --tensorboard-dir, --load, --data-cache-path).

A run that cannot write its checkpoints should stop before the model is built, not after the first --save-interval
of work; a --load that is a plain file is not a checkpoint folder (Megatron would start from scratch). Nothing here
creates a folder: the checks look at what exists (the nearest existing parent of a folder still to be created).
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron.errors import ArgumentError


def _existing_parent(path: str) -> str:
    """`path` itself when it exists, else its nearest existing parent folder."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def folder_problem(path: str) -> Optional[str]:
    """Why `path` cannot be (or become) a folder this process writes into; None when it can."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a folder"
    existing = _existing_parent(path)
    if not os.path.isdir(existing):
        return f"cannot be created: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return "is not writable" if existing == os.path.abspath(path) else \
            f"cannot be created: {existing} is not writable"
    return None


def check_output_folders(args: argparse.Namespace) -> None:
    """One line for a --save or --tensorboard-dir that is a file or not writable."""
    for flag, dest, fix in (("--save", "save", "point --save at a folder you can write to"),
                            ("--tensorboard-dir", "tensorboard_dir",
                             "point --tensorboard-dir at a folder you can write to")):
        path = getattr(args, dest, None)
        if path:
            problem = folder_problem(path)
            if problem is not None:
                raise ArgumentError(f"{flag} {path} {problem}; {fix}")


def check_load_folder(args: argparse.Namespace) -> None:
    """--load must name a checkpoint folder: a plain file is refused (it would start from scratch)."""
    path = getattr(args, "load", None)
    if path and os.path.isfile(path):
        raise ArgumentError(f"--load {path} is a file, not a checkpoint folder; point --load at the folder --save "
                            "wrote (the one holding latest_checkpointed_iteration.txt)")
