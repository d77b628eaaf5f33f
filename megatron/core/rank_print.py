"""Printing on one rank: the one `print_rank_0` / `print_rank_last` of the project (Megatron's import paths
`megatron.utils.print_rank_0`, `megatron.print_rank_0`-style re-exports point here).

A line is written with one write() call (`print_line`): under PYTHONUNBUFFERED=1 `print` makes two (the text, then
the newline), and ranks sharing one stdout (torchrun's workers, the tasks srun starts on one node) then glue one
rank's line to the end of another's.

Light on purpose: torch is never imported here. torch.distributed is consulted only when some other module already
imported torch (an initialised process group implies that), so `tools/preprocess_data.py` stays torch-free.
"""
from __future__ import annotations

import sys
from typing import Any, Optional


def _dist() -> Optional[Any]:
    """torch.distributed when torch is imported and a process group is initialised, else None."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def rank_and_world() -> tuple[int, int]:
    """(global rank, world size); (0, 1) without an initialised process group."""
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist is not None else (0, 1)


def is_rank_0() -> bool:
    return rank_and_world()[0] == 0


def is_last_rank() -> bool:
    rank, world = rank_and_world()
    return rank == world - 1


def print_line(message: Any) -> None:
    """`print(message, flush=True)` in one write() call, so that a line never interleaves with another process's."""
    sys.stdout.write(f"{message}\n")
    sys.stdout.flush()


def print_rank_0(message: Any) -> None:
    """Print on global rank 0 only (everywhere when torch.distributed is not initialised)."""
    if is_rank_0():
        print_line(message)


def print_rank_last(message: Any) -> None:
    """Print on the last global rank (the one holding the loss under pipeline parallelism), like Megatron."""
    if is_last_rank():
        print_line(message)
