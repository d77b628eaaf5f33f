"""Broadcast a batch (dict of same-dtype tensors) from tensor-parallel rank 0 to the rest of its TP group.

Megatron's `broadcast_data`: only TP rank 0 needs to read the data; the others receive the shapes, then one flat
buffer. Entry scripts may instead let every TP rank read the identical batch (this project's pretrain_gpt.py does).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import group_rank, group_size

_MAX_DIMS = 8


def _comm_device(group: Any) -> torch.device:
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_data(keys: Iterable[str], data: Optional[Dict[str, torch.Tensor]], datatype: torch.dtype,
                   tp_group: Any = None) -> Dict[str, torch.Tensor]:
    """Return {key: tensor} on every rank of `tp_group`, taken from `data` on TP rank 0 (ignored elsewhere)."""
    keys = list(keys)
    if group_size(tp_group) == 1:
        if data is None:
            raise ValueError("broadcast_data: data is None on tensor-parallel rank 0")
        return {k: _checked(data, k, datatype) for k in keys}
    device = _comm_device(tp_group)
    src = dist.get_global_rank(tp_group, 0)
    is_src = group_rank(tp_group) == 0
    sizes = torch.zeros(len(keys), _MAX_DIMS, dtype=torch.int64, device=device)
    if is_src:
        if data is None:
            raise ValueError("broadcast_data: data is None on tensor-parallel rank 0")
        for i, k in enumerate(keys):
            shape = _checked(data, k, datatype).shape
            if len(shape) > _MAX_DIMS:
                raise ValueError(f"broadcast_data: {k!r} has {len(shape)} dims (at most {_MAX_DIMS})")
            sizes[i, : len(shape)] = torch.tensor(shape, dtype=torch.int64)
            sizes[i, len(shape):] = -1
    dist.broadcast(sizes, src, group=tp_group)
    shapes = [[int(d) for d in row if d >= 0] for row in sizes.tolist()]
    numels = [int(torch.tensor(s).prod()) if s else 1 for s in shapes]
    if is_src:
        flat = torch.cat([data[k].contiguous().view(-1).to(device) for k in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=tp_group)
    out, offset = {}, 0
    for k, shape, n in zip(keys, shapes, numels):
        out[k] = flat[offset: offset + n].view(shape)
        offset += n
    return out


def _checked(data: Dict[str, torch.Tensor], key: str, datatype: torch.dtype) -> torch.Tensor:
    if key not in data:
        raise KeyError(f"broadcast_data: key {key!r} missing from the batch (has {sorted(data)})")
    if data[key].dtype != datatype:
        raise TypeError(f"broadcast_data: {key!r} has dtype {data[key].dtype}, expected {datatype}")
    return data[key]
