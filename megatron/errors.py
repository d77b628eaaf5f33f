"""User-facing errors: problems with flags, files or checkpoints that entry scripts print as one line.

Library code raises a subclass of `MegatronUserError` (which also derives from the usual ValueError/RuntimeError)
with a message that names the flag or file and the fix; `exit_on_user_error` turns it into `error: <message>` on
stderr and exit code 1 instead of a traceback. Imports nothing heavy (the preprocessing tools use it too).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, TypeVar

from megatron import peer_failure

T = TypeVar("T")


class MegatronUserError(Exception):
    """Bad input from the user (flags, data files, checkpoints); the message says what to change."""


class ArgumentError(MegatronUserError, ValueError):
    """A bad combination of command-line flags (one line, names the flags and the fix).

    Re-exported by megatron.arguments (its historical home); defined here so that modules below `arguments` (the
    DeepSpeed config reconciler, the flag registry, initialize) raise it without importing `arguments`.
    """


def _report_user_error(line: str) -> None:
    """Print the line; under megatron.quiet_torchrun (MEGATRON_USER_ERROR_DIR set) only rank 0 prints and every rank
    leaves the line in that folder for the launcher."""
    folder, rank = os.environ.get("MEGATRON_USER_ERROR_DIR"), os.environ.get("RANK", "0")
    if not folder or rank == "0":
        print(line, file=sys.stderr, flush=True)
    if folder and os.path.isdir(folder):
        tmp = os.path.join(folder, f".rank{rank}.{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(line + "\n")
        os.replace(tmp, os.path.join(folder, f"rank{rank}.txt"))


def exit_on_user_error(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `fn`; a MegatronUserError becomes one line on stderr and exit code 1 (process group torn down).

    A lost peer of a distributed run (a rank died or hung) also becomes one line naming it and exit code 1
    (megatron/peer_failure.py); other exceptions propagate unchanged.
    """
    try:
        return fn(*args, **kwargs)
    except MegatronUserError as exc:
        _report_user_error(f"error: {exc}")
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        sys.exit(1)
    except Exception as exc:
        if "torch.distributed" in sys.modules:
            if peer_failure.peer_failure_in_run(exc):
                peer_failure.exit_on_peer_failure(exc)
        raise


class InputFileError(MegatronUserError, ValueError):
    """A file named by a flag (--vocab-file, --merge-file, --tokenizer-model, ...) is unreadable or of the wrong kind;
    the message starts with the flag and the path."""


class InputFileNotFoundError(MegatronUserError, FileNotFoundError):
    """A file named by a flag does not exist; the message starts with the flag and the path."""
