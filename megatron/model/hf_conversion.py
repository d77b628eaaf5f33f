"""Weight mapping between Megatron GPT state dicts and Hugging Face `GPT2LMHeadModel` state dicts.

Megatron (checkpoint_version >= 2) orders the fused query_key_value rows as [heads, (q, k, v), head_dim];
HF's c_attn is a Conv1D (weight stored [in, out]) with output columns ordered [(q, k, v), heads, head_dim].
Every other HF Conv1D weight is the transpose of the Megatron linear weight. Only TP=1 (unsharded) dicts.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.model.gpt_model import flatten_checkpoint_state_dict

_LM = "language_model."
_ENC = _LM + "encoder."

# (megatron layer suffix, hf layer suffix, transpose?)
_LAYER_MAP = [
    ("input_layernorm.weight", "ln_1.weight", False),
    ("input_layernorm.bias", "ln_1.bias", False),
    ("self_attention.dense.weight", "attn.c_proj.weight", True),
    ("self_attention.dense.bias", "attn.c_proj.bias", False),
    ("post_attention_layernorm.weight", "ln_2.weight", False),
    ("post_attention_layernorm.bias", "ln_2.bias", False),
    ("mlp.dense_h_to_4h.weight", "mlp.c_fc.weight", True),
    ("mlp.dense_h_to_4h.bias", "mlp.c_fc.bias", False),
    ("mlp.dense_4h_to_h.weight", "mlp.c_proj.weight", True),
    ("mlp.dense_4h_to_h.bias", "mlp.c_proj.bias", False),
]


def _heads(config: TransformerConfig) -> tuple[int, int]:
    return config.num_attention_heads, config.kv_channels


def qkv_megatron_to_hf(t: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder qkv rows [heads, 3, hd] -> [3, heads, hd] (weight [3h, in] or bias [3h])."""
    rest = t.shape[1:]
    return t.reshape(num_heads, 3, head_dim, *rest).transpose(0, 1).reshape(3 * num_heads * head_dim, *rest)


def qkv_hf_to_megatron(t: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder qkv rows [3, heads, hd] -> [heads, 3, hd]."""
    rest = t.shape[1:]
    return t.reshape(3, num_heads, head_dim, *rest).transpose(0, 1).reshape(3 * num_heads * head_dim, *rest)


def _num_layers(flat: Mapping[str, Any]) -> int:
    ids = {int(k[len(_ENC) + len("layers."):].split(".")[0]) for k in flat if k.startswith(_ENC + "layers.")}
    if ids != set(range(len(ids))):
        raise ValueError(f"Megatron state dict has non-contiguous layer indices {sorted(ids)}")
    return len(ids)


def megatron_gpt_to_hf_state_dict(state_dict: Mapping[str, Any], config: TransformerConfig) -> dict:
    """Megatron GPT state dict (nested checkpoint layout or flat module names, TP=1) -> GPT2LMHeadModel dict."""
    flat = flatten_checkpoint_state_dict(state_dict)
    need = _LM + "embedding.word_embeddings.weight"
    if need not in flat:
        raise ValueError(f"not a full TP=1/PP=1 Megatron GPT state dict: missing {need!r}")
    nh, hd = _heads(config)
    out: dict = {
        "transformer.wte.weight": flat[need],
        "transformer.wpe.weight": flat[_LM + "embedding.position_embeddings.weight"],
    }
    for i in range(_num_layers(flat)):
        src = f"{_ENC}layers.{i}."
        dst = f"transformer.h.{i}."
        out[dst + "attn.c_attn.weight"] = qkv_megatron_to_hf(
            flat[src + "self_attention.query_key_value.weight"], nh, hd
        ).t().contiguous()
        out[dst + "attn.c_attn.bias"] = qkv_megatron_to_hf(flat[src + "self_attention.query_key_value.bias"], nh, hd)
        for m_name, h_name, transpose in _LAYER_MAP:
            t = flat[src + m_name]
            out[dst + h_name] = t.t().contiguous() if transpose else t
    out["transformer.ln_f.weight"] = flat[_ENC + "final_layernorm.weight"]
    out["transformer.ln_f.bias"] = flat[_ENC + "final_layernorm.bias"]
    out["lm_head.weight"] = flat.get(_LM + "output_layer.weight", out["transformer.wte.weight"])
    return out


def hf_to_megatron_gpt_state_dict(hf_state_dict: Mapping[str, Any], config: TransformerConfig) -> dict:
    """GPT2LMHeadModel (or GPT2Model with 'transformer.' keys) dict -> flat Megatron GPT module names (TP=1)."""
    sd = dict(hf_state_dict)
    if "transformer.wte.weight" not in sd and "wte.weight" in sd:
        sd = {f"transformer.{k}": v for k, v in sd.items()}
    if "transformer.wte.weight" not in sd:
        raise ValueError("not a Hugging Face GPT-2 state dict: missing 'transformer.wte.weight'")
    nh, hd = _heads(config)
    out: dict = {
        _LM + "embedding.word_embeddings.weight": sd["transformer.wte.weight"],
        _LM + "embedding.position_embeddings.weight": sd["transformer.wpe.weight"],
    }
    layer_ids = {int(k.split(".")[2]) for k in sd if k.startswith("transformer.h.")}
    for i in range(len(layer_ids)):
        src = f"transformer.h.{i}."
        dst = f"{_ENC}layers.{i}."
        out[dst + "self_attention.query_key_value.weight"] = qkv_hf_to_megatron(
            sd[src + "attn.c_attn.weight"].t(), nh, hd
        ).contiguous()
        out[dst + "self_attention.query_key_value.bias"] = qkv_hf_to_megatron(sd[src + "attn.c_attn.bias"], nh, hd)
        for m_name, h_name, transpose in _LAYER_MAP:
            t = sd[src + h_name]
            out[dst + m_name] = t.t().contiguous() if transpose else t
    out[_ENC + "final_layernorm.weight"] = sd["transformer.ln_f.weight"]
    out[_ENC + "final_layernorm.bias"] = sd["transformer.ln_f.bias"]
    if not config.share_embeddings_and_output_weights and "lm_head.weight" in sd:
        out[_LM + "output_layer.weight"] = sd["lm_head.weight"]
    return out


def hf_gpt2_config_kwargs(config: TransformerConfig) -> dict:
    """Keyword arguments for transformers.GPT2Config describing the same architecture."""
    return dict(
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size,
        n_positions=config.max_position_embeddings,
        vocab_size=config.padded_vocab_size,
        activation_function="gelu_new" if config.openai_gelu else "gelu",
        layer_norm_epsilon=config.layernorm_epsilon,
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        scale_attn_by_inverse_layer_idx=False,
        tie_word_embeddings=config.share_embeddings_and_output_weights,
    )
