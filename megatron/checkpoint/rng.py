"""The RNG states a checkpoint holds: this process's python/numpy/torch/CUDA generators and the tensor-parallel RNG
tracker, one entry per data-parallel rank (Megatron's ``rng_state`` list)."""
from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch

from megatron.checkpoint.paths import CheckpointError
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import get_rng_tracker


def local_rng_state() -> dict[str, Any]:
    """This process's python/numpy/torch/CUDA generator states and the tensor-parallel RNG tracker states."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": get_rng_tracker().get_states(),
    }


def restore_local_rng_state(rng: dict[str, Any]) -> None:
    """Inverse of ``local_rng_state``."""
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    if torch.cuda.is_available() and rng.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(rng["cuda_rng_state"])
    tracker_states = rng.get("rng_tracker_states")
    if tracker_states is None:
        raise CheckpointError("checkpoint has no rng_tracker_states; resume with --no-load-rng")
    get_rng_tracker().set_states(tracker_states)


def get_rng_state(state: Optional[ps.ParallelState] = None) -> list[dict[str, Any]]:
    """This rank's RNG states, gathered over the data-parallel group (one dict per DP rank, as Megatron)."""
    state = ps.current_parallel_state(state)
    rng = local_rng_state()
    if state.dp_group is not None and state.dp_size > 1:
        gathered: list[Any] = [None] * state.dp_size
        torch.distributed.all_gather_object(gathered, rng, group=state.dp_group)
        return gathered
    return [rng]


def set_rng_state(rng_state_list: list[dict[str, Any]], state: Optional[ps.ParallelState] = None) -> None:
    """Restore the RNG states saved by ``get_rng_state`` (this DP rank's entry, or entry 0 if there is only one)."""
    state = ps.current_parallel_state(state)
    if isinstance(rng_state_list, dict):  # very old checkpoints stored a single dict
        rng_state_list = [rng_state_list]
    idx = state.dp_rank if len(rng_state_list) > state.dp_rank else 0
    restore_local_rng_state(rng_state_list[idx])
