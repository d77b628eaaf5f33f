"""`python -m megatron.quiet_torchrun [torchrun flags] script.py [flags]`: torchrun for the example scripts, where a
user error (bad flag, wrong file: `error: ...` and exit code 1 from `megatron.errors.exit_on_user_error`) prints once,
from rank 0, and the launcher exits 1 without torch elastic's crash report (a traceback plus a failure table, about
35 lines, that buries the one line that matters).

How: the workers get MEGATRON_USER_ERROR_DIR; on a user error rank 0 prints its line, every rank writes its line to
`rank<N>.txt` there (other ranks print nothing). When the job fails and every failed worker left such a file, this
launcher prints the lowest rank's line if rank 0 did not print one, and exits 1. Any other failure (a crash, a
signal) keeps torchrun's full report and exit code. Without this launcher (plain torchrun) every rank prints its line.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from typing import Optional

ERROR_DIR_ENV = "MEGATRON_USER_ERROR_DIR"


class _DropUserErrorExits(logging.Filter):
    """Hide the elastic agent's 'failed (exitcode: 1)' and 'closing signal SIGTERM' records (a crash still gets its
    failure table with the exit codes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "(exitcode: 1)" not in message and "closing signal SIGTERM" not in message


def _user_errors(folder: str) -> dict[int, str]:
    out = {}
    for name in os.listdir(folder):
        if name.startswith("rank") and name.endswith(".txt"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                out[int(name[4:-4])] = f.read().strip()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    folder = tempfile.mkdtemp(prefix="megatron-user-errors-")
    os.environ[ERROR_DIR_ENV] = folder  # inherited by the workers
    quiet = _DropUserErrorExits()
    for name in ("", "torch.distributed.elastic", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(quiet)
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(quiet)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
        return 0
    except ChildFailedError as exc:
        errors = _user_errors(folder)
        failed = set(exc.failures)
        if errors and failed and all(rank in errors for rank in failed):
            if 0 not in errors:  # rank 0 printed nothing: say the lowest rank's line once
                print(errors[min(errors)], file=sys.stderr, flush=True)
            return 1
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
