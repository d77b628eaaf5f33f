"""What the families' Hugging Face mappings share (below every family folder, so no family imports another's):
the fused query_key_value row order of Megatron's ungrouped attention, zero-padding to the padded vocabulary, the
layer count of a flat state dict and reading a folder's config through transformers."""
from __future__ import annotations

from typing import Any, Mapping

import torch

LM = "language_model."
ENC = LM + "encoder."


def qkv_megatron_to_hf(t: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder qkv rows [heads, 3, hd] -> [3, heads, hd] (weight [3h, in] or bias [3h])."""
    rest = t.shape[1:]
    return t.reshape(num_heads, 3, head_dim, *rest).transpose(0, 1).reshape(3 * num_heads * head_dim, *rest)


def qkv_hf_to_megatron(t: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder qkv rows [3, heads, hd] -> [heads, 3, hd]."""
    rest = t.shape[1:]
    return t.reshape(3, num_heads, head_dim, *rest).transpose(0, 1).reshape(3 * num_heads * head_dim, *rest)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad `t` to `rows` rows (the padded vocabulary); ValueError when it has more."""
    if t.size(0) == rows:
        return t
    if t.size(0) > rows:
        raise ValueError(f"vocabulary of {t.size(0)} rows does not fit the padded vocab size {rows}")
    return torch.cat([t, t.new_zeros(rows - t.size(0), *t.shape[1:])])


def encoder_layer_count(flat: Mapping[str, Any]) -> int:
    """The number of ``language_model.encoder.layers.<i>`` of a flat Megatron state dict (ValueError when the
    layer numbers are not 0..n-1)."""
    ids = {int(k[len(ENC) + len("layers."):].split(".")[0]) for k in flat if k.startswith(ENC + "layers.")}
    if ids != set(range(len(ids))):
        raise ValueError(f"Megatron state dict has non-contiguous layer indices {sorted(ids)}")
    return len(ids)


def hf_config_class(name: str) -> Any:
    """``transformers.<name>`` (a config class such as "LlamaConfig"; transformers, an optional dependency, is
    imported here on first use)."""
    import transformers

    return getattr(transformers, name)


def hf_config_object(load_dir: str) -> Any:
    """The transformers config object of a HF folder (read locally, never from the Hub)."""
    return hf_config_class("AutoConfig").from_pretrained(load_dir, local_files_only=True)
