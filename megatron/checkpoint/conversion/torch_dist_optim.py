"""The optimizer state inside `torch_dist` folders, in Megatron Core's model-space layout.

Megatron Core's distributed optimizer (megatron-core 0.16, ``DistributedOptimizer.sharded_state_dict``) stores its
state in one of several layouts, named in ``common.pt`` under ``optimizer.param_state_sharding_type``:

* ``fully_reshardable`` (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``): per model tensor and state key one
  global tensor shaped like the parameter's global (TP=1, layers stacked) tensor, named
  ``optimizer.state.<key>.<model tensor name>`` with key ``param`` (the fp32 main param), ``exp_avg``, ``exp_avg_sq``;
  ``fully_sharded_model_space`` (older) is the same with ``fp32_param`` for the main param. Both reshard to any
  TP/PP/DP layout; this module reads both and writes ``fully_reshardable``.
* ``dp_reshardable`` (Megatron-LM 0.16's default): flat buffers in the bucket order of Megatron Core's own gradient
  buffers (Megatron-LM reads them back at the same TP/PP layout only); torch_dist_buckets.py rebuilds that order and
  turns them into the model-space state above, so they too resume at any layout here.
* ``dp_zero_gather_scatter`` (deprecated): refused in one line naming the flag that writes the reshardable layout.

The non-tensor part sits in ``common.pt``: ``optimizer = {"optimizer": {"param_groups": [hyperparameters, "step"]},
"grad_scaler"?: ..., "param_state_sharding_type": ...}`` (Megatron Core keeps the Adam step count in each param group),
and ``opt_param_scheduler`` beside it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint.conversion.interchange import ConversionError
from megatron.checkpoint.conversion.torch_dist_buckets import BUCKETS, describe
from megatron.optimizer.distrib_optimizer import PARAM_STATE_FORMAT

PREFIX = "optimizer.state."
SHARDING_TYPE = "fully_reshardable"
MODEL_SPACE = ("fully_reshardable", "fully_sharded_model_space")
PARAM = "param"
MOMENTUM = "momentum_buffer"  # Muon's state (megatron-core's TensorParallelMuon)
_ALIASES = {"fp32_param": PARAM}  # fully_sharded_model_space's name of the fp32 main param
# torch's implementation switches in a param group: the loading run keeps its own (Megatron Core's are for its GPUs)
_IMPLEMENTATION = ("params", "step", "foreach", "fused", "capturable", "differentiable")


def split_optimizer_tensors(tensors: Dict[str, torch.Tensor]
                            ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]:
    """(model tensors, {state key: {model tensor name: tensor}}) of a torch_dist folder's tensors."""
    model: Dict[str, torch.Tensor] = {}
    state: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith(PREFIX):
            skey, _, name = key[len(PREFIX):].partition(".")
            state.setdefault(_ALIASES.get(skey, skey), {})[name] = t
        elif key.startswith("optimizer."):
            continue  # bucket-space layouts (refused by optimizer_common when the optimizer state is asked for)
        else:
            model[key] = t
    return model, state


def sharding_type(common: Dict[str, Any]) -> Optional[str]:
    opt = common.get("optimizer")
    return opt.get("param_state_sharding_type") if isinstance(opt, dict) else None


def incomplete_names(state: Dict[str, Dict[str, torch.Tensor]]) -> List[str]:
    """The tensors whose state is incomplete: without every key; with ``momentum_buffer`` (--optimizer muon, Megatron
    Core's name for Muon's state), without the fp32 param or without either the momentum or all the other keys."""
    names = set().union(*[set(v) for v in state.values()])
    if MOMENTUM not in state:
        return sorted(names ^ set(state[PARAM]))
    adam = [k for k in state if k not in (PARAM, MOMENTUM)]
    return sorted(n for n in names if n not in state[PARAM] or not (
        n in state[MOMENTUM] and not any(n in state[k] for k in adam)
        or n not in state[MOMENTUM] and all(n in state[k] for k in adam)))


def optimizer_common(common: Dict[str, Any], state: Dict[str, Dict[str, torch.Tensor]], where: str
                     ) -> Dict[str, Any]:
    """The layout-independent part of a torch_dist folder's optimizer state, as the checkpoint converters carry it
    (``param_groups`` without params, ``grad_scaler``, ``step``, ``state_keys``); one-line errors when the folder has
    no optimizer state we can read."""
    kind = sharding_type(common)
    if kind == BUCKETS and describe(common):
        raise ConversionError(describe(common))
    if kind is not None and kind not in (*MODEL_SPACE, BUCKETS):
        raise ConversionError(f"{where}: its distributed optimizer state is in Megatron Core's {kind} layout, which "
                              "this code does not read; save it with --dist-ckpt-optim-fully-reshardable, or load "
                              "with --no-load-optim")
    if not state or kind is None:
        raise ConversionError(f"{where} holds no optimizer state: pass --no-load-optim (or --finetune)")
    if PARAM not in state:
        raise ConversionError(f"{where}: the optimizer state has {sorted(state)} but no fp32 main params "
                              f"({PREFIX}param.*): an incomplete checkpoint; pass --no-load-optim")
    missing = incomplete_names(state)
    if missing:
        raise ConversionError(f"{where}: the optimizer state of {missing[0]} is incomplete; restore the checkpoint "
                              "or pass --no-load-optim")
    opt = common["optimizer"]
    groups = list((opt.get("optimizer") or {}).get("param_groups", []))
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) > 1:
        raise ConversionError(f"{where}: its param groups record different step counts {sorted(steps)}")
    out: Dict[str, Any] = {"param_groups": [{k: v for k, v in g.items() if k not in _IMPLEMENTATION}
                                            for g in groups],
                           "step": steps.pop() if steps else 0.0,
                           "state_keys": sorted(k for k in state if k != PARAM)}
    if opt.get("grad_scaler") is not None:
        out["grad_scaler"] = opt["grad_scaler"]
    return out


def common_entry(opt_common: Dict[str, Any]) -> Dict[str, Any]:
    """common.pt's ``optimizer`` entry for writing (Megatron Core's: the step count in every param group)."""
    step = float(opt_common.get("step", 0.0))
    # Megatron Core matches saved groups to its own by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)
    groups = [{"is_expert_parallel": False, "is_decoupled_lr": False,
               **{k: v for k, v in g.items() if k != "params"}, "step": step}
              for g in opt_common.get("param_groups", [])]
    out: Dict[str, Any] = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": SHARDING_TYPE}
    if opt_common.get("grad_scaler") is not None:
        out["grad_scaler"] = opt_common["grad_scaler"]
    return out


def state_tensors(per_key: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """{state key: {model tensor name: tensor}} -> the folder's ``optimizer.state.<key>.<name>`` fp32 tensors."""
    return {f"{PREFIX}{key}.{name}": t.detach().float().contiguous().clone()
            for key, tensors in per_key.items() for name, t in tensors.items()}


def param_state(entries_per_chunk: List[Dict[str, Dict[str, torch.Tensor]]], opt_common: Dict[str, Any]
                ) -> Dict[str, Any]:
    """This framework's distributed-optimizer parameter state (what `load_parameter_state` takes) from per-chunk
    {parameter name: {"param", "exp_avg", ...}} entries already cut to this rank."""
    return {"format": PARAM_STATE_FORMAT, "step": float(opt_common.get("step", 0.0)),
            "state_keys": list(opt_common.get("state_keys", [])), "chunks": entries_per_chunk,
            "saved_data_parallel_size": None}


def _group_key(group: Dict[str, Any]) -> Tuple[float, float]:
    return float(group.get("wd_mult", 1.0)), float(group.get("lr_mult", 1.0))


def optimizer_sd(opt_common: Dict[str, Any], current_groups: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The non-sharded optimizer entry our optimizers' ``load_state_dict`` (distributed) or the conversion to the
    regular optimizer take: param-group hyperparameters (matched to `current_groups` by wd_mult / lr_mult, as Megatron
    Core matches them; this run's torch switches such as ``fused`` kept) and the grad scaler."""
    saved = [dict(g) for g in opt_common.get("param_groups", [])]
    by_key = {_group_key(g): g for g in saved}
    if len(by_key) == len(saved) == len(current_groups) and all(_group_key(g) in by_key for g in current_groups):
        saved = [by_key[_group_key(g)] for g in current_groups]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, **(saved[i] if i < len(saved) else {})}
              for i, g in enumerate(current_groups)]
    if len(saved) != len(current_groups):
        raise ConversionError(f"the checkpoint's optimizer has {len(saved)} param groups, this run "
                              f"{len(current_groups)}: it is from a different model; pass --no-load-optim")
    out: Dict[str, Any] = {"distributed_optimizer": True, "optimizer": {"param_groups": groups, "state": {}}}
    if opt_common.get("grad_scaler") is not None:
        out["grad_scaler"] = opt_common["grad_scaler"]
    return out
