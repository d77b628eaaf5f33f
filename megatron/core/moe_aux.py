"""MoE auxiliary losses: how their gradient enters backward, and their per-layer record for the log line.

Megatron-LM core attaches each router loss (load balancing, z-loss) to an activation with `AuxLossAutoScaler`:
forward is the identity, backward adds ``d aux / d inputs`` scaled by the main loss's backward scale
(fp16 loss scale / number of micro-batches, set by the schedule through `set_aux_loss_scale`). So the router
loss needs no plumbing through the model's outputs and works across pipeline stages.

The values are also recorded per layer (`record`) and turned into Megatron's log entries `load_balancing_loss`,
`z_loss` by `reduce_aux_losses` (summed over pipeline stages, the reduce group and averaged over data-parallel
ranks as Megatron-LM's ``reduce_aux_losses_tracker_across_ranks`` does, then averaged over MoE layers).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

_BACKWARD_SCALE = {"value": 1.0}
# name -> {"values": tensor[num_layers], "reduce_group": group or None}
_TRACKER: Dict[str, Dict[str, Any]] = {}


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
    return _BACKWARD_SCALE["value"]


def record(name: str, value: torch.Tensor, layer_number: Optional[int], num_layers: int,
           reduce_group: Any = None) -> None:
    """Add a layer's loss value (already divided by its coefficient) to the tracker."""
    if layer_number is None:
        return
    entry = _TRACKER.get(name)
    if entry is None or entry["values"].numel() != num_layers:
        entry = _TRACKER[name] = {"values": torch.zeros(num_layers, dtype=torch.float32)}
    entry["values"][layer_number - 1] += value.detach().float().to(entry["values"].device)
    entry["reduce_group"] = reduce_group


def clear() -> None:
    _TRACKER.clear()


def tracked() -> Dict[str, torch.Tensor]:
    """name -> per-layer values recorded since the last clear (a copy)."""
    return {k: v["values"].clone() for k, v in _TRACKER.items()}


def reduce_aux_losses(names: list, num_layers: int, num_moe_layers: int, loss_scale: float,
                      pp_group: Any = None, dp_group: Any = None, reduce_groups: Optional[dict] = None,
                      per_layer: bool = False) -> Dict[str, float]:
    """{name: sum over layers / num_moe_layers * loss_scale} (+ moe/<name>_layer_<i> with `per_layer`); clears.

    Every rank passes the same `names` (a stage without MoE layers contributes zeros), so the collectives match.
    `reduce_groups`: name -> the group its values are summed over before the data-parallel average (Megatron's
    tensor/context-parallel group for the load-balancing losses; none for the z-loss, which is not averaged).
    """
    out: Dict[str, float] = {}
    for name in names:
        entry = _TRACKER.get(name)
        values = entry["values"].clone() if entry is not None else torch.zeros(num_layers)
        if dist.is_available() and dist.is_initialized():
            if pp_group is not None and dist.get_world_size(pp_group) > 1:
                dist.all_reduce(values, group=pp_group)
            group = (reduce_groups or {}).get(name)
            if group is not None:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(values, group=group)
                if dp_group is not None and dist.get_world_size(dp_group) > 1:
                    dist.all_reduce(values, group=dp_group)
                    values /= dist.get_world_size(dp_group)
        values = values * loss_scale
        out[name] = float(values.sum()) / max(1, num_moe_layers)
        if per_layer:
            for i, v in enumerate(values.tolist()):
                out[f"moe/{name}_layer_{i}"] = v
    clear()
    return out
