"""Weight and config mapping between Megatron BERT state dicts (TP=1, flat) and HF `MegatronBertForPreTraining`.

HF's MegatronBert has Megatron's architecture (pre-LN layers, final ``encoder.ln``, no embedding LayerNorm, pooler,
LM-head transform, tied decoder + bias, ``seq_relationship`` = binary head). Differences the mapping handles:
query_key_value rows are Megatron's [heads, (q, k, v), head_dim] and HF has separate query/key/value; HF has one
``hidden_act`` for the MLP and the LM head, so equal logits need Megatron's MLP to use the LM head's activation
(``--no-bias-gelu-fusion`` -> erf "gelu", ``--openai-gelu`` -> "gelu_new" for both); ``layer_norm_eps`` must be
Megatron's (1e-5); a model without the binary head has no token types (HF gets zero token-type rows) and no pooler
or ``seq_relationship`` (HF keeps its own, unused). Shared with the checkpoint-conversion tools.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.layers.mlp import activation_for
from megatron.models.gpt.hf import qkv_hf_to_megatron, qkv_megatron_to_hf

_LM = "language_model."
_EMB = _LM + "embedding."
_ENC = _LM + "encoder."

# (Megatron name, HF name) outside the layers
_TOP = [
    (_EMB + "word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
    (_EMB + "position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
    (_ENC + "final_layernorm.weight", "bert.encoder.ln.weight"),
    (_ENC + "final_layernorm.bias", "bert.encoder.ln.bias"),
    ("lm_head.dense.weight", "cls.predictions.transform.dense.weight"),
    ("lm_head.dense.bias", "cls.predictions.transform.dense.bias"),
    ("lm_head.layernorm.weight", "cls.predictions.transform.LayerNorm.weight"),
    ("lm_head.layernorm.bias", "cls.predictions.transform.LayerNorm.bias"),
    ("lm_head.bias", "cls.predictions.bias"),
]
_BINARY = [
    (_EMB + "tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"),
    (_LM + "pooler.dense.weight", "bert.pooler.dense.weight"),
    (_LM + "pooler.dense.bias", "bert.pooler.dense.bias"),
    ("binary_head.weight", "cls.seq_relationship.weight"),
    ("binary_head.bias", "cls.seq_relationship.bias"),
]
# per layer (Megatron suffix, HF suffix)
_LAYER = [
    ("input_layernorm.weight", "attention.ln.weight"),
    ("input_layernorm.bias", "attention.ln.bias"),
    ("self_attention.dense.weight", "attention.output.dense.weight"),
    ("self_attention.dense.bias", "attention.output.dense.bias"),
    ("post_attention_layernorm.weight", "ln.weight"),
    ("post_attention_layernorm.bias", "ln.bias"),
    ("mlp.dense_h_to_4h.weight", "intermediate.dense.weight"),
    ("mlp.dense_h_to_4h.bias", "intermediate.dense.bias"),
    ("mlp.dense_4h_to_h.weight", "output.dense.weight"),
    ("mlp.dense_4h_to_h.bias", "output.dense.bias"),
]


def _layer_ids(flat: Mapping[str, Any], prefix: str) -> list[int]:
    ids = sorted({int(k[len(prefix):].split(".")[0]) for k in flat if k.startswith(prefix)})
    if ids != list(range(len(ids))):
        raise ValueError(f"layer numbers {ids} are not 0..n-1: pass a full (all pipeline stages) state dict")
    return ids


def has_binary_head(state_dict: Mapping[str, Any]) -> bool:
    """Whether a Megatron BERT state dict (nested or flat) has the binary head (and so token types and a pooler)."""
    return "binary_head.weight" in flatten_checkpoint_state_dict(state_dict)


def megatron_bert_to_hf_state_dict(state_dict: Mapping[str, Any], config: TransformerConfig) -> dict:
    """Megatron BERT (TP=1, all stages, nested or flat) -> `MegatronBertForPreTraining` state dict.

    Without the binary head, HF's token-type rows are zeros and its pooler / seq_relationship are left out (HF keeps
    its own initial values; load with strict=False).
    """
    flat = flatten_checkpoint_state_dict(state_dict)
    heads, hd = config.num_attention_heads, config.kv_channels
    out: dict = {}
    for meg, hf in _TOP:
        out[hf] = flat[meg]
    out["cls.predictions.decoder.weight"] = flat[_EMB + "word_embeddings.weight"]
    out["cls.predictions.decoder.bias"] = flat["lm_head.bias"]
    if "binary_head.weight" in flat:
        for meg, hf in _BINARY:
            out[hf] = flat[meg]
    else:
        word = flat[_EMB + "word_embeddings.weight"]
        out["bert.embeddings.token_type_embeddings.weight"] = torch.zeros(2, word.size(1), dtype=word.dtype)
    for i in _layer_ids(flat, _ENC + "layers."):
        src, dst = f"{_ENC}layers.{i}.", f"bert.encoder.layer.{i}."
        for meg, hf in _LAYER:
            out[dst + hf] = flat[src + meg]
        for kind in ("weight", "bias"):
            q, k, v = qkv_megatron_to_hf(flat[f"{src}self_attention.query_key_value.{kind}"], heads, hd).chunk(3)
            out[f"{dst}attention.self.query.{kind}"] = q
            out[f"{dst}attention.self.key.{kind}"] = k
            out[f"{dst}attention.self.value.{kind}"] = v
    return out


def hf_to_megatron_bert_state_dict(hf_state_dict: Mapping[str, Any], config: TransformerConfig,
                                   binary_head: bool = True) -> dict:
    """`MegatronBertForPreTraining` state dict -> flat Megatron BERT state dict (TP=1)."""
    heads, hd = config.num_attention_heads, config.kv_channels
    out: dict = {}
    for meg, hf in _TOP + (_BINARY if binary_head else []):
        out[meg] = hf_state_dict[hf]
    prefix = "bert.encoder.layer."
    for i in _layer_ids(hf_state_dict, prefix):
        src, dst = f"{prefix}{i}.", f"{_ENC}layers.{i}."
        for meg, hf in _LAYER:
            out[dst + meg] = hf_state_dict[src + hf]
        for kind in ("weight", "bias"):
            qkv = torch.cat([hf_state_dict[f"{src}attention.self.{n}.{kind}"] for n in ("query", "key", "value")])
            out[f"{dst}self_attention.query_key_value.{kind}"] = qkv_hf_to_megatron(qkv, heads, hd)
    return out


def hf_megatron_bert_activation(config: TransformerConfig) -> str:
    """HF hidden_act giving Megatron's numbers; one-line error when the MLP and LM-head activations differ."""
    name, _ = activation_for(config)
    if name == "openai_gelu":
        return "gelu_new"  # Megatron's LM head uses openai_gelu too under --openai-gelu
    if name == "gelu":
        return "gelu"
    raise ValueError(f"HF MegatronBert has one activation for the MLP and the LM head; Megatron's MLP uses {name} "
                     "while its LM head uses erf GeLU: train with --no-bias-gelu-fusion (or --openai-gelu)")


def hf_megatron_bert_config_kwargs(config: TransformerConfig, vocab_size: Optional[int] = None) -> dict:
    """MegatronBertConfig keyword arguments for a Megatron BERT config (vocab = the padded vocabulary)."""
    return dict(
        vocab_size=vocab_size or config.padded_vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.ffn_hidden_size,
        max_position_embeddings=config.max_position_embeddings,
        type_vocab_size=2,
        layer_norm_eps=config.layernorm_epsilon,
        hidden_act=hf_megatron_bert_activation(config),
        hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        tie_word_embeddings=True,
    )
