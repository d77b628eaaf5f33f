"""Megatron's parameter groups (weight decay on weights only, optional lr scaling), shared by every optimizer.

A leaf of the optimizer package: the distributed optimizer's checkpoint conversion uses the same order.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

import torch

ParamCond = Callable[[str, torch.nn.Parameter], bool]


def get_param_groups(
    model_chunks: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    no_weight_decay_cond: Optional[ParamCond] = None,
    scale_lr_cond: Optional[ParamCond] = None,
    lr_mult: float = 1.0,
) -> List[dict]:
    """Megatron's grouping: weight decay on weights only (not biases or 1-D params such as norm weights);
    `lr_mult` on params selected by `scale_lr_cond`. Groups carry `wd_mult`/`lr_mult` for the scheduler and come
    in Megatron's order: (wd, lr), (wd, scaled lr), (no wd, lr), (no wd, scaled lr); empty groups are dropped.
    """
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    buckets = {(True, False): [], (True, True): [], (False, False): [], (False, True): []}
    seen = set()
    for module in model_chunks:
        for name, param in module.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if no_weight_decay_cond is not None:
                no_wd = no_weight_decay_cond(name, param)
            else:
                no_wd = name.endswith(".bias") or len(param.shape) == 1
            scale_lr = scale_lr_cond(name, param) if scale_lr_cond is not None else False
            buckets[(not no_wd, scale_lr)].append(param)
    groups = []
    for (wd, scale_lr), params in buckets.items():
        if params:
            groups.append({"params": params, "wd_mult": 1.0 if wd else 0.0, "lr_mult": lr_mult if scale_lr else 1.0})
    return groups
