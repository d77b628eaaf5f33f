"""Megatron-LM's checkpoint layout on disk: folder and file names, the tracker file, the errors, and what every rank
of a save or load shares (rank 0 prints, barriers, the first failing rank's reason, the safe file read).

Layout (same as Megatron-LM, so its tools and ours read each other's folders)::

    <save>/latest_checkpointed_iteration.txt          "1000" or "release"
    <save>/iter_0001000/mp_rank_00/model_optim_rng.pt   (PP == 1)
    <save>/iter_0001000/mp_rank_00_000/model_optim_rng.pt (PP > 1: tensor rank, pipeline rank)
    <save>/iter_0001000/mp_rank_00[_000]_001/...          (expert parallelism: + expert rank, 3 digits)
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from megatron.checkpoint import integrity
from megatron.checkpoint.safe_load import safe_torch_load
from megatron.core import parallel_state as ps
from megatron.errors import MegatronUserError


class CheckpointError(MegatronUserError, RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit this run (the message names the flag to change)."""


CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def reshard_hint(load_dir: str) -> str:
    """The command that changes a checkpoint's TP/PP sizes (with its optimizer state, so the run continues)."""
    if load_dir.endswith(".pt"):  # .../iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt -> the --load directory
        load_dir = os.path.dirname(os.path.dirname(os.path.dirname(load_dir)))
    return (f"reshard it: python tools/checkpoint/convert.py --model-type GPT --load-dir {load_dir} --save-dir NEW "
            "--target-tensor-parallel-size N --target-pipeline-parallel-size M, then --load NEW --no-load-rng "
            "(MoE: add --target-expert-parallel-size E to the convert.py command)")


def print0(msg: str) -> None:
    """Print on global rank 0 only (every rank when torch.distributed is not initialised is rank 0)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, flush=True)


def is_rank0() -> bool:
    """Global rank 0, or a single process."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def barrier() -> None:
    """A barrier over all ranks (nothing in a single process)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# ----------------------------------------------------------------------------------------------- paths
def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    """Path of the text file holding the latest saved iteration (or ``release``)."""
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def get_checkpoint_name(
    checkpoints_path: str,
    iteration: int,
    release: bool = False,
    pipeline_parallel: Optional[bool] = None,
    tensor_rank: Optional[int] = None,
    pipeline_rank: Optional[int] = None,
    expert_parallel: Optional[bool] = None,
    expert_rank: Optional[int] = None,
) -> str:
    """Megatron's ``.../iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` for this (or the
    given) rank."""
    state = ps.current_parallel_state()
    if pipeline_parallel is None:
        pipeline_parallel = state.pp_size > 1
    if expert_parallel is None:
        expert_parallel = state.ep_size > 1
    tensor_rank = state.tp_rank if tensor_rank is None else tensor_rank
    pipeline_rank = state.pp_rank if pipeline_rank is None else pipeline_rank
    expert_rank = state.ep_rank if expert_rank is None else expert_rank
    directory = "release" if release else f"iter_{iteration:07d}"
    rank_dir = f"mp_rank_{tensor_rank:02d}" + (f"_{pipeline_rank:03d}" if pipeline_parallel else "")
    rank_dir += f"_{expert_rank:03d}" if expert_parallel else ""
    return os.path.join(checkpoints_path, directory, rank_dir, "model_optim_rng.pt")


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name: str) -> str:
    """``distrib_optim.pt`` in the folder of ``model_optim_rng.pt`` (Megatron's name)."""
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


def model_file_name(checkpoint_name: str) -> str:
    """``model_optim_rng.pt``, or the ``model_rng.pt`` Megatron-LM writes beside a separate optimizer file."""
    alt = os.path.join(os.path.dirname(checkpoint_name), "model_rng.pt")
    return alt if not os.path.isfile(checkpoint_name) and os.path.isfile(alt) else checkpoint_name


def read_metadata(tracker_filename: str) -> tuple[int, bool]:
    """Read the tracker file: (iteration, release). One-line error when its content is not an integer/'release'."""
    try:
        text = integrity.read_pointer_file(tracker_filename)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(
            f"{tracker_filename} must contain an iteration number or 'release', found {text!r}; "
            "fix or delete the file"
        ) from None
    if iteration < 0:
        raise CheckpointError(f"{tracker_filename} holds a negative iteration ({iteration})")
    if torch.distributed.is_initialized():
        iters = torch.tensor([iteration], dtype=torch.long)
        torch.distributed.all_reduce(iters, op=torch.distributed.ReduceOp.MAX)
        if int(iters.item()) != iteration:
            print(f"WARNING: on rank {torch.distributed.get_rank()} found iteration {iteration} in {tracker_filename}"
                  f" but the max over ranks is {int(iters.item())}", flush=True)
    return iteration, False


def iteration_dir(load_dir: str, iteration: int, release: bool) -> str:
    """``<load_dir>/iter_XXXXXXX`` (or ``release``): the folder of one saved iteration."""
    return os.path.join(load_dir, "release" if release else f"iter_{iteration:07d}")


def find_rank_dirs(iter_dir: str) -> list[str]:
    """The ``mp_rank_*`` folders of an iteration folder, sorted (none when it does not exist)."""
    if not os.path.isdir(iter_dir):
        return []
    return sorted(d for d in os.listdir(iter_dir) if d.startswith("mp_rank_"))


def first_failure_reason(reason: Optional[str]) -> Optional[str]:
    """The first rank's failure reason (None when every rank's files verified and loaded); collective."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        reasons: list[Optional[str]] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(reasons, reason)
        return next((r for r in reasons if r is not None), None)
    return reason


def load_state_dict_file(path: str, trust: bool = False) -> dict[str, Any]:
    """torch.load through megatron.checkpoint.safe_load: weights-only plus the checkpoint allow-list, unless ``trust``
    (--trust-checkpoint / MEGATRON_TRUST_CHECKPOINT=1); anything else is a one-line UnsafeCheckpointError."""
    return safe_torch_load(path, map_location="cpu", trust=trust)
