"""Per-iteration state updates a model's modules declare, applied once the backward pass of all micro-batches is
done (Megatron-LM core's ``_update_router_expert_bias`` in finalize_model_grads: the MoE router's aux-loss-free
expert bias).

A module declares one by a ``step_counts()`` method returning an fp32 tensor of counts it gathered in the forward
passes of this iteration (None: nothing to update) and ``apply_step_update(global_counts)``. `apply_step_updates`
stacks every declaring module's counts, sums them over the groups of ranks that saw different tokens with the same
weights (TP, then data-parallel with context parallel: Megatron-LM's tensor-and-data-parallel group with CP) and
hands each module its sums. The loop and the backends know no module kind: they call this after backward.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Sequence

import torch
import torch.distributed as dist

from megatron.core import saved_state


def declaring_modules(model_chunks: Iterable[torch.nn.Module]) -> List[torch.nn.Module]:
    """The modules of `model_chunks` (wrappers walked through) with counts to reduce this iteration, in order."""
    found = []
    for chunk in model_chunks:
        for module in chunk.modules():
            counts = getattr(module, "step_counts", None)
            if callable(counts) and counts() is not None:
                found.append(module)
    return found


def apply_step_updates(model_chunks: Iterable[torch.nn.Module], groups: Sequence[Any]) -> None:
    """Sum the declared counts over each of `groups` (None or size 1: skipped) and let each module update itself.
    Collective over `groups` when any module declares counts (every rank of a stage declares the same ones)."""
    modules = declaring_modules(model_chunks)
    if not modules:
        return
    saved_state.wait_for_copies()  # --async-save: the checkpoint's copy of the expert bias must be complete
    counts = torch.stack([m.step_counts().float() for m in modules])
    if dist.is_available() and dist.is_initialized():
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(counts, group=group)
    for module, summed in zip(modules, counts):
        module.apply_step_update(summed)
