"""Auxiliary losses a model declares by name (MoE's load balancing and z-loss; later MTP): how their gradient enters
backward, their per-layer record, and their reduction into the named values the training loop logs.

Megatron-LM core attaches each auxiliary loss to an activation with `AuxLossAutoScaler`: forward is the identity,
backward adds ``d aux / d inputs`` scaled by the main loss's backward scale (fp16 loss scale / number of
micro-batches, set by the schedule through `set_aux_loss_scale`). So an auxiliary loss needs no plumbing through the
model's outputs and works across pipeline stages.

The values are also recorded per layer (`record`, by the layer computing them). A model declares its losses as
`AuxLoss` records in an ``aux_losses`` attribute of one of its modules (every rank the same declarations, from the
config, so a pipeline stage without the recording layers takes part in the reductions); the loop finds them with
`declared_by` and turns them into the log line's values with `reduce_named_losses` (summed over pipeline stages and
the loss's reduce group, averaged over data-parallel ranks as Megatron-LM's ``reduce_aux_losses_tracker_across_ranks``
does, then averaged over the recording layers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

_BACKWARD_SCALE = {"value": 1.0}
# name -> {"values": tensor[num_layers]}
_TRACKER: Dict[str, Dict[str, Any]] = {}


@dataclass(frozen=True)
class AuxLoss:
    """An auxiliary loss a model declares: its log name and how the loop reduces it."""

    name: str  # the log line's name (Megatron-LM's: load_balancing_loss, z_loss, ...)
    num_layers: int  # length of the per-layer record (the model's layers)
    num_recording_layers: int  # the logged value is the sum over layers / this (MoE: the MoE layers)
    dp_average: bool = False  # summed over `reduce_group`, then averaged over data-parallel ranks (False: neither)
    reduce_group: Any = None  # with dp_average: the group summed over first (None: none)
    per_layer_key: Optional[str] = None  # TensorBoard scalars "<per_layer_key>_layer_<i>" (None: none)


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; backward also sends the current backward scale into `aux_loss`."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, _BACKWARD_SCALE["value"])


def set_aux_loss_scale(scale: float) -> None:
    """The main loss's backward scale (loss scale / micro-batches); the schedules set it before backward."""
    _BACKWARD_SCALE["value"] = float(scale)


def set_scale_for_schedule(num_microbatches: int, grad_scale_func: Optional[Callable]) -> None:
    """Called by the schedules: the main loss's backward scale is (fp16 loss scale) / micro-batches."""
    scale = 1.0 if grad_scale_func is None else float(grad_scale_func(torch.ones(1)).reshape(-1)[0])
    set_aux_loss_scale(scale / num_microbatches)


def aux_loss_scale() -> float:
    """The current backward scale of the auxiliary losses."""
    return _BACKWARD_SCALE["value"]


def record(name: str, value: torch.Tensor, layer_number: Optional[int], num_layers: int) -> None:
    """Add a layer's loss value (already divided by its coefficient) to the tracker."""
    if layer_number is None:
        return
    entry = _TRACKER.get(name)
    if entry is None or entry["values"].numel() != num_layers:
        entry = _TRACKER[name] = {"values": torch.zeros(num_layers, dtype=torch.float32)}
    entry["values"][layer_number - 1] += value.detach().float().to(entry["values"].device)


def clear() -> None:
    """Forget every recorded value."""
    _TRACKER.clear()


def tracked() -> Dict[str, torch.Tensor]:
    """name -> per-layer values recorded since the last clear (a copy)."""
    return {k: v["values"].clone() for k, v in _TRACKER.items()}


def declared_by(model_chunks: Iterable[torch.nn.Module]) -> Tuple[AuxLoss, ...]:
    """The auxiliary losses the modules of `model_chunks` declare (their ``aux_losses``; wrappers such as DDP or an
    engine are walked through), each name once, in module order."""
    found: Dict[str, AuxLoss] = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            for loss in getattr(module, "aux_losses", ()):
                found.setdefault(loss.name, loss)
    return tuple(found.values())


def _reduced(loss: AuxLoss, pp_group: Any, dp_group: Any) -> torch.Tensor:
    entry = _TRACKER.get(loss.name)
    values = entry["values"].clone() if entry is not None else torch.zeros(loss.num_layers)
    if dist.is_available() and dist.is_initialized():
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            dist.all_reduce(values, group=pp_group)
        group = loss.reduce_group
        if loss.dp_average:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(values, group=group)
            if dp_group is not None and dist.get_world_size(dp_group) > 1:
                dist.all_reduce(values, group=dp_group)
                values /= dist.get_world_size(dp_group)
    return values


def reduce_named_losses(declared: Sequence[AuxLoss], loss_scale: float, pp_group: Any = None,
                        dp_group: Any = None) -> Tuple[Dict[str, float], Dict[str, float]]:
    """({name: sum over layers * loss_scale / num_recording_layers}, {per-layer TensorBoard key: value}); clears.

    Collective: every rank passes the same `declared` (a stage without recording layers contributes zeros), so the
    reductions match.
    """
    values: Dict[str, float] = {}
    per_layer: Dict[str, float] = {}
    for loss in declared:
        reduced = _reduced(loss, pp_group, dp_group) * loss_scale
        values[loss.name] = float(reduced.sum()) / max(1, loss.num_recording_layers)
        if loss.per_layer_key is not None:
            for i, v in enumerate(reduced.tolist()):
                per_layer[f"{loss.per_layer_key}_layer_{i}"] = v
    clear()
    return values, per_layer
