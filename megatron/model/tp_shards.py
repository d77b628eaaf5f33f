"""Split a full (TP=1) Megatron GPT state dict into tensor-parallel shards and merge shards back.

Partition rules follow Megatron's layers: column-parallel weights/biases (query_key_value, dense_h_to_4h,
word embeddings, untied output layer) split along dim 0, row-parallel weights (attention dense, dense_4h_to_h)
along dim 1; everything else (LayerNorms, row-parallel biases, position embeddings) is replicated. The fused
query_key_value rows are head-major ([heads, (q, k, v), head_dim]), so a plain split keeps whole heads per rank.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

_DIM0_SUFFIXES = (
    "word_embeddings.weight",
    "self_attention.query_key_value.weight",
    "self_attention.query_key_value.bias",
    "inter_attention.query.weight",
    "inter_attention.query.bias",
    "inter_attention.key_value.weight",
    "inter_attention.key_value.bias",
    "mlp.dense_h_to_4h.weight",
    "mlp.dense_h_to_4h.bias",
    "output_layer.weight",
)
_DIM1_SUFFIXES = (
    "self_attention.dense.weight",
    "inter_attention.dense.weight",
    "mlp.dense_4h_to_h.weight",
)


def tensor_parallel_dim(name: str) -> Optional[int]:
    """The dimension a parameter is split along under tensor parallelism, or None when replicated."""
    if name.endswith(_DIM0_SUFFIXES):
        return 0
    if name.endswith(_DIM1_SUFFIXES):
        return 1
    return None


def split_tensor_parallel_state_dict(state_dict: Mapping[str, Any], tp_size: int) -> list[dict]:
    """Flat full state dict -> `tp_size` flat shard dicts (rank order)."""
    shards: list[dict] = [{} for _ in range(tp_size)]
    for name, value in state_dict.items():
        dim = tensor_parallel_dim(name) if isinstance(value, torch.Tensor) else None
        if dim is None:
            for shard in shards:
                shard[name] = value
            continue
        if value.size(dim) % tp_size != 0:
            raise ValueError(
                f"{name}: size {value.size(dim)} along dim {dim} is not divisible by tensor parallel size {tp_size}"
            )
        for rank, part in enumerate(value.chunk(tp_size, dim=dim)):
            shards[rank][name] = part.clone()
    return shards


def merge_tensor_parallel_state_dicts(shards: Sequence[Mapping[str, Any]]) -> dict:
    """Flat shard dicts (rank order) -> one full flat state dict."""
    if not shards:
        raise ValueError("merge_tensor_parallel_state_dicts: no shards given")
    keys = list(shards[0].keys())
    for rank, shard in enumerate(shards[1:], start=1):
        if list(shard.keys()) != keys:
            raise ValueError(f"tensor parallel shard {rank} has different parameter names than shard 0")
    merged: dict = {}
    for name in keys:
        dim = tensor_parallel_dim(name) if isinstance(shards[0][name], torch.Tensor) else None
        merged[name] = shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim=dim)
    return merged
