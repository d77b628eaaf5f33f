"""Fused QKV row orders of old Megatron checkpoints: checkpoint_version 0 stores each tensor rank's query_key_value
rows as [3, heads, d], 1.0 as [heads, d, 3]; 2.0 and later as [heads, 3, d] (what the layers use). Megatron's
``fix_query_key_value_ordering`` reorders on load; so do our checkpoint loader and converter."""
from __future__ import annotations

from typing import Any, Dict

import torch


def fix_qkv_ordering(t: torch.Tensor, version: float, num_heads: int, head_dim: int) -> torch.Tensor:
    """One tensor rank's query_key_value weight/bias of `version` -> the >= 2.0 order ([heads, 3, d] rows)."""
    if version >= 2.0:
        return t
    rest = t.shape[1:]
    if version == 0:
        return t.reshape(3, num_heads, head_dim, *rest).transpose(0, 1).reshape(t.shape).contiguous()
    if version == 1.0:
        return t.reshape(num_heads, head_dim, 3, *rest).transpose(1, 2).reshape(t.shape).contiguous()
    raise ValueError(f"checkpoint_version {version} is unknown (0, 1.0, 2.0 and 3.0 exist)")


def fix_state_dict_qkv(state_dict: Dict[str, Any], version: float, num_heads: int, head_dim: int) -> Dict[str, Any]:
    """A (nested) model state dict with every query_key_value tensor reordered from `version` (new dicts)."""
    if version >= 2.0:
        return state_dict
    out: Dict[str, Any] = {}
    for key, value in state_dict.items():
        if isinstance(value, dict):
            out[key] = fix_state_dict_qkv(value, version, num_heads, head_dim)
        elif isinstance(value, torch.Tensor) and "query_key_value" in key:
            out[key] = fix_qkv_ordering(value, version, num_heads, head_dim)
        else:
            out[key] = value
    return out


def has_qkv(state_dict: Dict[str, Any]) -> bool:
    """Whether a (nested) state dict holds any query_key_value tensor."""
    return any(has_qkv(v) if isinstance(v, dict) else "query_key_value" in k for k, v in state_dict.items())
