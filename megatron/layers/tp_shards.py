"""Split a full (TP=1) Megatron GPT state dict into tensor-parallel shards and merge shards back.

How each parameter splits is owned by the parameter (`param.tp_layout`, megatron.core.tensor_parallel.layout):
column-parallel weights/biases along dim 0 (SwiGLU's dense_h_to_4h as [gate; up] per rank, GQA's query_key_value
in whole KV groups), row-parallel weights along dim 1, everything else replicated. `tensor_parallel_layouts` reads
them from a built model or from a `TransformerConfig` (a weightless model on the meta device); pass the result
(or `config=`) to the functions below. Without either, the layouts are those of Megatron's GPT layers recognised
from the parameter names, with SwiGLU told apart from a plain MLP by the shapes (dense_h_to_4h has twice the rows
of dense_4h_to_h's columns); a grouped-query query_key_value is refused there (its KV groups need the config).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from megatron.core.tensor_parallel.layout import REPLICATED, TensorParallelLayout, get_tp_layout
from megatron.core.transformer_config import TransformerConfig

Layouts = Mapping[str, TensorParallelLayout]

# Fallback only (state dicts that come with neither a model nor a config): the layouts the GPT layers declare.
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


def tensor_parallel_layouts(source: Union[torch.nn.Module, TransformerConfig]) -> dict[str, TensorParallelLayout]:
    """{flat parameter name: layout} of a model, or of the TP=1 GPT model a config describes (built on meta)."""
    if isinstance(source, TransformerConfig):
        from megatron.models.gpt.model import GPTModel

        cfg = dataclasses.replace(source, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None, sequence_parallel=False,
                                  use_cpu_initialization=True,
                                  padded_vocab_size=max(source.padded_vocab_size, 1))
        with torch.device("meta"):
            source = GPTModel(cfg)
    return {name: get_tp_layout(p) for name, p in source.named_parameters()}


def _swiglu_layers(state_dict: Mapping[str, Any]) -> set:
    out = set()
    for name, value in state_dict.items():
        if name.endswith("mlp.dense_h_to_4h.weight") and isinstance(value, torch.Tensor):
            down = state_dict.get(name.replace("dense_h_to_4h", "dense_4h_to_h"))
            if isinstance(down, torch.Tensor) and value.size(0) == 2 * down.size(1):
                out.add(name[: -len("dense_h_to_4h.weight")])
    return out


def tensor_parallel_dim(name: str) -> Optional[int]:
    """The dimension a GPT parameter is split along (by its name), or None when replicated (fallback rule)."""
    if name.endswith(_DIM0_SUFFIXES):
        return 0
    if name.endswith(_DIM1_SUFFIXES):
        return 1
    return None


def _check_not_grouped(state_dict: Mapping[str, Any]) -> None:
    """Refuse grouped-query QKV without layouts: which rows form a KV group cannot be told from the shapes."""
    for name, value in state_dict.items():
        if name.endswith("self_attention.query_key_value.weight") and isinstance(value, torch.Tensor):
            dense = state_dict.get(name.replace("query_key_value", "dense"))
            if isinstance(dense, torch.Tensor) and value.size(0) != 3 * dense.size(1):
                raise ValueError(f"{name} is a grouped-query (GQA) weight: pass config= or layouts= so that "
                                 "resharding keeps whole KV groups")


def _fallback_layouts(state_dict: Mapping[str, Any], gated: set) -> dict[str, TensorParallelLayout]:
    _check_not_grouped(state_dict)
    layouts = {}
    for name in state_dict:
        dim = tensor_parallel_dim(name)
        blocks = 2 if dim == 0 and name.rsplit("dense_h_to_4h.", 1)[0] in gated else 1
        layouts[name] = REPLICATED if dim is None else TensorParallelLayout(dim=dim, blocks=blocks)
    return layouts


def _resolve(state_dict: Mapping[str, Any], layouts: Optional[Layouts], config: Optional[TransformerConfig],
             gated_from: Mapping[str, Any]) -> Layouts:
    if layouts is None and config is not None:
        layouts = tensor_parallel_layouts(config)
    if layouts is None:
        # a shard's dense_h_to_4h rows and dense_4h_to_h columns are both 1/tp of the full ones: same ratio test
        return _fallback_layouts(state_dict, _swiglu_layers(gated_from))
    return layouts


def split_tensor_parallel_state_dict(state_dict: Mapping[str, Any], tp_size: int, *,
                                     layouts: Optional[Layouts] = None,
                                     config: Optional[TransformerConfig] = None) -> list[dict]:
    """Flat full state dict -> `tp_size` flat shard dicts (rank order)."""
    layouts = _resolve(state_dict, layouts, config, state_dict)
    shards: list[dict] = [{} for _ in range(tp_size)]
    for name, value in state_dict.items():
        layout = layouts.get(name, REPLICATED) if isinstance(value, torch.Tensor) else REPLICATED
        if layout.replicated:
            for shard in shards:
                shard[name] = value
            continue
        for rank, part in enumerate(layout.split(value, tp_size, name)):
            shards[rank][name] = part
    return shards


def merge_tensor_parallel_state_dicts(shards: Sequence[Mapping[str, Any]], *, layouts: Optional[Layouts] = None,
                                      config: Optional[TransformerConfig] = None) -> dict:
    """Flat shard dicts (rank order) -> one full flat state dict."""
    if not shards:
        raise ValueError("merge_tensor_parallel_state_dicts: no shards given")
    keys = list(shards[0].keys())
    for rank, shard in enumerate(shards[1:], start=1):
        if list(shard.keys()) != keys:
            raise ValueError(f"tensor parallel shard {rank} has different parameter names than shard 0")
    layouts = _resolve(shards[0], layouts, config, shards[0])
    merged: dict = {}
    for name in keys:
        layout = layouts.get(name, REPLICATED) if isinstance(shards[0][name], torch.Tensor) else REPLICATED
        merged[name] = layout.merge([s[name] for s in shards], name)
    return merged
