"""Per-rank checkpoints of runs with --expert-tensor-parallel-size T > 1 other than TP: the experts are stored whole.

Megatron-LM's folders ``mp_rank_TT[_PPP][_EEE]`` name the dense TP rank and the expert rank, not the expert-TP rank,
so ranks holding different expert-TP shards of the same experts map to one folder (Megatron-LM's legacy writers then
overwrite each other). Here every rank all-gathers its experts' weights, fp32 main params and optimizer moments over
the expert-TP group before the folder's writer (parallel_state.checkpoint_writer) saves them, so each folder holds its
expert rank's experts whole, as a run with expert-TP 1 writes them (Megatron-LM itself has no per-rank layout for
expert-TP shards: it supports them in torch_dist only); on loading each rank takes its expert-TP slice again. With T = 1 < TP nothing moves:
the experts are whole on every rank already. megatron/checkpoint/conversion/megatron_format.py reads such checkpoints
(experts_stored_whole) for tools/checkpoint/convert.py and --ckpt-format torch_dist.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.layout import TensorParallelLayout, get_tp_layout
from megatron.layers.module import unwrap_model
from megatron.optimizer.distrib_optimizer import model_param_order
from megatron.run_configs.saved_args import SavedRunArgs

EXPERT_PARAM_RE = re.compile(r"(^|\.)mlp\.experts\.(weight[12]|bias[12])$")  # the stacked experts (megatron/layers/moe.py)
Transform = Callable[[torch.Tensor, TensorParallelLayout], torch.Tensor]


def active(state: Any) -> bool:
    """This run splits its experts over an expert-TP group other than the TP group (T > 1)."""
    return bool(getattr(state, "expert_tp_differs", False)) and (getattr(state, "etp_size", 1) or 1) > 1


def saved_whole(args: Any) -> bool:
    """The checkpoint whose saved args are `args` holds whole experts: saved with expert-TP != TP (this module), or
    with expert-TP (= TP) 1."""
    saved = SavedRunArgs.from_args(args)
    tp = saved.tensor_model_parallel_size or 1
    etp = saved.expert_tensor_parallel_size or tp
    return etp != tp or etp == 1


def _layouts(models: List[torch.nn.Module]) -> Dict[str, TensorParallelLayout]:
    """{'weight1' | 'weight2' | 'bias1' | 'bias2': the experts' split over the expert-TP group}."""
    out: Dict[str, TensorParallelLayout] = {}
    for chunk in models:
        for name, param in unwrap_model(chunk).named_parameters():
            m = EXPERT_PARAM_RE.search(name)
            if m:
                out.setdefault(m.group(2), get_tp_layout(param))
    return out


def gather(state: Any) -> Transform:
    """This rank's expert-TP shard -> the whole tensor (collective over the expert-TP group)."""
    def run(t: torch.Tensor, layout: TensorParallelLayout) -> torch.Tensor:
        parts = [torch.empty(t.shape, dtype=torch.float32) for _ in range(state.etp_size)]
        dist.all_gather(parts, t.detach().float().contiguous(), group=state.etp_group)
        return layout.merge(parts).to(t.dtype)
    return run


def take_slice(state: Any) -> Transform:
    """The whole tensor -> this rank's expert-TP shard."""
    def run(t: torch.Tensor, layout: TensorParallelLayout) -> torch.Tensor:
        return layout.split(t, state.etp_size)[state.etp_rank]
    return run


def model_state(sd: Dict[str, Any], models: List[torch.nn.Module], fn: Transform) -> Dict[str, Any]:
    """The nested model state dict with `fn` applied to every expert stack (a new dict; other values shared)."""
    layouts = _layouts(models)

    def walk(node: Any, prefix: str) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, f"{prefix}{k}.") for k, v in node.items()}
        m = EXPERT_PARAM_RE.search(prefix[:-1])
        return fn(node, layouts[m.group(2)]) if m and torch.is_tensor(node) else node
    return walk(sd, "")


def _expert_flags(models: List[torch.nn.Module]) -> List[Optional[TensorParallelLayout]]:
    """The expert layout (None: not an expert) of each parameter in the regular optimizer's flat order."""
    flags = []
    for _, name, param in model_param_order(models):
        m = EXPERT_PARAM_RE.search(name)
        flags.append(get_tp_layout(param) if m else None)
    return flags


def regular_optimizer_state(optim_sd: Dict[str, Any], models: List[torch.nn.Module], fn: Transform
                            ) -> Dict[str, Any]:
    """A regular (FP32Optimizer / Float16Optimizer) optimizer state dict with `fn` applied to the experts' moments and
    fp32 main params (a new dict; the live optimizer's tensors are left alone)."""
    nested = "optimizer" in optim_sd and "param_groups" not in optim_sd
    inner = optim_sd["optimizer"] if nested else optim_sd
    flags = _expert_flags(models)
    indices = [i for group in inner["param_groups"] for i in group["params"]]
    state = dict(inner["state"])
    for index, layout in zip(indices, flags):
        if layout is not None and index in state:
            state[index] = {k: fn(v, layout) if torch.is_tensor(v) and v.dim() > 0 else v
                            for k, v in state[index].items()}
    out = dict(optim_sd)
    new_inner = {**inner, "state": state}
    if not nested:
        return new_inner
    out["optimizer"] = new_inner
    if optim_sd.get("fp32_from_fp16_params"):  # fp32 main copies of the fp16/bf16 params, in the same order
        order = iter(zip(model_param_order(models), flags))
        groups = []
        for group in optim_sd["fp32_from_fp16_params"]:
            new_group = []
            for main in group:
                (_, _, param), layout = next(order)
                while param.dtype == torch.float32:
                    (_, _, param), layout = next(order)
                new_group.append(fn(main, layout) if layout is not None else main)
            groups.append(new_group)
        out["fp32_from_fp16_params"] = groups
    return out


def param_state(saved: Dict[str, Any], fn: Transform, models: List[torch.nn.Module]) -> Dict[str, Any]:
    """The distributed optimizer's per-parameter state (distrib_optim.pt) with `fn` applied to the experts' entries."""
    layouts = _layouts(models)
    chunks = []
    for chunk in saved["chunks"]:
        new = {}
        for name, entry in chunk.items():
            m = EXPERT_PARAM_RE.search(name)
            new[name] = {k: fn(v, layouts[m.group(2)]) for k, v in entry.items()} if m else entry
        chunks.append(new)
    return {**saved, "chunks": chunks}
