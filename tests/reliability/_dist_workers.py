"""Module-level worker for the 2-process reliability test (must pickle for `run_distributed`): several
pretrain_gpt.main runs in one process, with a hook between them that rank 0 runs (e.g. to damage a file)."""
from __future__ import annotations

import contextlib
import io
from typing import Any, Callable, Optional


def _reset() -> None:
    from megatron.core import parallel_state
    from megatron.global_vars import unset_global_variables

    parallel_state.destroy_model_parallel()
    unset_global_variables()


def run_sequence(rank: int, world_size: int, runs: list[list[str]],
                 between: Optional[Callable[[int], Any]] = None) -> list[dict]:
    """Each argv in turn; `between(i)` on rank 0 after run i (all ranks wait for it). Returns stdout/error per run."""
    import torch

    import pretrain_gpt

    out = []
    for i, argv in enumerate(runs):
        buf = io.StringIO()
        error = None
        with contextlib.redirect_stdout(buf):
            try:
                pretrain_gpt.main(argv)
            except (RuntimeError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            finally:
                _reset()
        out.append({"stdout": buf.getvalue(), "error": error})
        if between is not None and rank == 0:
            between(i)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    return out


def flip_a_bit(path: str, after_run: int, i: int) -> None:
    """`between` hook: after run `after_run`, flip one bit in the middle of `path` (same size)."""
    if i != after_run:
        return
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x10
        f.seek(0)
        f.write(bytes(data))
