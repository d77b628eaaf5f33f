"""Weight and config mapping between Megatron GPT-family state dicts and Hugging Face models (TP=1 dicts).

GPT-2 (`GPT2LMHeadModel`): Megatron (checkpoint_version >= 2) orders the fused query_key_value rows as
[heads, (q, k, v), head_dim]; HF's c_attn is a Conv1D (weight stored [in, out]) with output columns ordered
[(q, k, v), heads, head_dim]. Every other HF Conv1D weight is the transpose of the Megatron linear weight. The MLP
activation maps as Megatron computes it: bias-gelu fusion (Megatron's default) and --openai-gelu are the tanh
approximation (HF "gelu_new"), --no-bias-gelu-fusion is erf GeLU (HF "gelu").

Llama family (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`; Megatron-LM's layouts):
query_key_value is grouped per KV group ``[q of the group's heads; k; v]`` (HF q/k/v_proj need no RoPE permutation:
both use the half-split convention), dense_h_to_4h is ``[gate_proj; up_proj]``, norms are RMSNorm weights, the
output layer is untied (``output_layer.weight``). The functions here are reused by the checkpoint tools.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.layers.mlp import activation_for

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
    return _shift_ln_1p(out, config, +1.0)


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
    return _shift_ln_1p(out, config, -1.0)


def _check_gpt2(config: TransformerConfig) -> None:
    if (config.normalization != "LayerNorm" or config.position_embedding_type != "learned_absolute"
            or not config.add_bias_linear or config.num_query_groups != config.num_attention_heads):
        raise ValueError("Hugging Face GPT-2 has LayerNorm, learned positions, biases and one K/V head per query "
                         "head; use the Llama-family mapping for this model")


def _shift_ln_1p(sd: dict, config: TransformerConfig, delta: float) -> dict:
    """--apply-layernorm-1p stores gamma - 1: add 1 for HF's plain LayerNorm (delta +1) or remove it (-1)."""
    _check_gpt2(config)
    if not config.apply_layernorm_1p:
        return sd
    return {k: v + delta if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight", "layernorm.weight")) else v
            for k, v in sd.items()}


def hf_gpt2_activation(config: TransformerConfig) -> str:
    """HF GPT-2 `activation_function` computing what the Megatron MLP of `config` computes."""
    name = activation_for(config)[0]
    mapping = {"gelu_tanh": "gelu_new", "openai_gelu": "gelu_new", "gelu": "gelu"}
    if name not in mapping:
        raise ValueError(f"Hugging Face GPT-2 has no {name} MLP; convert this model with the Llama-family mapping")
    return mapping[name]


def hf_gpt2_config_kwargs(config: TransformerConfig) -> dict:
    """Keyword arguments for transformers.GPT2Config describing the same architecture."""
    return dict(
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size,
        n_positions=config.max_position_embeddings,
        vocab_size=config.padded_vocab_size,
        activation_function=hf_gpt2_activation(config),
        layer_norm_epsilon=config.layernorm_epsilon,
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        scale_attn_by_inverse_layer_idx=False,
        tie_word_embeddings=config.share_embeddings_and_output_weights,
    )


# ------------------------------------------------------------------------------------------------ Llama family
_LLAMA_LAYER_MAP = [
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.dense.weight", "self_attn.o_proj.weight"),
    ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.dense_4h_to_h.weight", "mlp.down_proj.weight"),
]


def qkv_pack_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int,
                    head_dim: int) -> torch.Tensor:
    """HF q/k/v rows ([nq*hd], [ng*hd], [ng*hd], weight or bias) -> Megatron's grouped [ng, (q x nq/ng, k, v), hd]."""
    rest = q.shape[1:]
    per = num_heads // num_groups
    return torch.cat([q.reshape(num_groups, per * head_dim, *rest), k.reshape(num_groups, head_dim, *rest),
                      v.reshape(num_groups, head_dim, *rest)], dim=1).reshape(-1, *rest)


def qkv_unpack_groups(qkv: torch.Tensor, num_heads: int, num_groups: int,
                      head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `qkv_pack_groups`: Megatron's grouped rows -> (q, k, v) rows in HF order."""
    rest = qkv.shape[1:]
    per = num_heads // num_groups
    grouped = qkv.reshape(num_groups, (per + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad `t` to `rows` rows (the padded vocabulary); ValueError when it has more."""
    if t.size(0) == rows:
        return t
    if t.size(0) > rows:
        raise ValueError(f"vocabulary of {t.size(0)} rows does not fit the padded vocab size {rows}")
    return torch.cat([t, t.new_zeros(rows - t.size(0), *t.shape[1:])])


def hf_llama_to_megatron_state_dict(hf_state_dict: Mapping[str, Any], config: TransformerConfig) -> dict:
    """Llama / Mistral / Qwen2 (`...ForCausalLM`) state dict -> flat Megatron GPT module names (TP=1).

    The vocabulary is zero-padded to `config.padded_vocab_size`; a tied HF model (no lm_head) gives the tied
    Megatron layout (no output_layer) when `config.share_embeddings_and_output_weights`.
    """
    sd = dict(hf_state_dict)
    if "model.embed_tokens.weight" not in sd:
        raise ValueError("not a Hugging Face Llama-family state dict: missing 'model.embed_tokens.weight'")
    nq, ng, hd = config.num_attention_heads, config.num_query_groups, config.kv_channels
    vocab = config.padded_vocab_size or sd["model.embed_tokens.weight"].size(0)
    out: dict = {_LM + "embedding.word_embeddings.weight": pad_rows(sd["model.embed_tokens.weight"], vocab)}
    layer_ids = {int(k.split(".")[2]) for k in sd if k.startswith("model.layers.")}
    for i in range(len(layer_ids)):
        src = f"model.layers.{i}."
        dst = f"{_ENC}layers.{i}."
        attn = src + "self_attn."
        out[dst + "self_attention.query_key_value.weight"] = qkv_pack_groups(
            sd[attn + "q_proj.weight"], sd[attn + "k_proj.weight"], sd[attn + "v_proj.weight"], nq, ng, hd)
        if attn + "q_proj.bias" in sd:
            out[dst + "self_attention.query_key_value.bias"] = qkv_pack_groups(
                sd[attn + "q_proj.bias"], sd[attn + "k_proj.bias"], sd[attn + "v_proj.bias"], nq, ng, hd)
        out[dst + "mlp.dense_h_to_4h.weight"] = torch.cat([sd[src + "mlp.gate_proj.weight"],
                                                          sd[src + "mlp.up_proj.weight"]], dim=0)
        for m_name, h_name in _LLAMA_LAYER_MAP:
            out[dst + m_name] = sd[src + h_name]
    out[_ENC + "final_layernorm.weight"] = sd["model.norm.weight"]
    if not config.share_embeddings_and_output_weights:
        head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        out[_LM + "output_layer.weight"] = pad_rows(head, vocab)
    return out


def megatron_to_hf_llama_state_dict(state_dict: Mapping[str, Any], config: TransformerConfig,
                                    vocab_size: Optional[int] = None) -> dict:
    """Megatron GPT state dict (nested or flat, TP=1) of a Llama-family model -> `LlamaForCausalLM`-style dict
    (Mistral and Qwen2 use the same names). `vocab_size` drops the padding rows."""
    flat = flatten_checkpoint_state_dict(state_dict)
    need = _LM + "embedding.word_embeddings.weight"
    if need not in flat:
        raise ValueError(f"not a full TP=1/PP=1 Megatron GPT state dict: missing {need!r}")
    nq, ng, hd = config.num_attention_heads, config.num_query_groups, config.kv_channels
    rows = slice(0, vocab_size)
    out: dict = {"model.embed_tokens.weight": flat[need][rows]}
    for i in range(_num_layers(flat)):
        src = f"{_ENC}layers.{i}."
        dst = f"model.layers.{i}."
        q, k, v = qkv_unpack_groups(flat[src + "self_attention.query_key_value.weight"], nq, ng, hd)
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v})
        bias = flat.get(src + "self_attention.query_key_value.bias")
        if bias is not None:
            q, k, v = qkv_unpack_groups(bias, nq, ng, hd)
            out.update({dst + "self_attn.q_proj.bias": q, dst + "self_attn.k_proj.bias": k,
                        dst + "self_attn.v_proj.bias": v})
        gate, up = flat[src + "mlp.dense_h_to_4h.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate.contiguous()
        out[dst + "mlp.up_proj.weight"] = up.contiguous()
        for m_name, h_name in _LLAMA_LAYER_MAP:
            out[dst + h_name] = flat[src + m_name]
    out["model.norm.weight"] = flat[_ENC + "final_layernorm.weight"]
    out["lm_head.weight"] = flat.get(_LM + "output_layer.weight", flat[need])[rows]
    return out


def megatron_config_from_hf_llama(hf_config: Any, **overrides: Any) -> TransformerConfig:
    """A TransformerConfig for a HF LlamaConfig / MistralConfig / Qwen2Config (dropouts 0; `overrides` win).

    Qwen2 (model_type "qwen2") gets the QKV bias. Mistral's sliding window is not modelled: it is refused when a
    sequence could exceed it (`max_position_embeddings > sliding_window`), unless overridden.
    """
    model_type = getattr(hf_config, "model_type", "llama")
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    scaling = rope_scaling_fields_from_hf(rope, hf_config.max_position_embeddings)
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError("Llama configs with attention_bias / mlp_bias are not supported")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r}: only SwiGLU (silu) Llama-family MLPs map to --swiglu")
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=heads,
        kv_channels=head_dim, ffn_hidden_size=hf_config.intermediate_size,
        max_position_embeddings=hf_config.max_position_embeddings, padded_vocab_size=hf_config.vocab_size,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=hf_config.rms_norm_eps,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope", rotary_base=float(theta),
        group_query_attention=groups != heads, num_query_groups=groups if groups != heads else None,
        add_bias_linear=False, add_qkv_bias=model_type == "qwen2", bias_gelu_fusion=False,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)), **scaling,
    )
    window = getattr(hf_config, "sliding_window", None)
    windowed = window is not None and getattr(hf_config, "use_sliding_window", None) is not False
    if windowed and hf_config.max_position_embeddings > window and "max_position_embeddings" not in overrides:
        raise ValueError(f"sliding_window {window} < max_position_embeddings {hf_config.max_position_embeddings}: "
                         "sliding-window attention is not modelled; pass max_position_embeddings <= the window")
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def rope_scaling_fields_from_hf(rope: Mapping[str, Any], max_position_embeddings: int) -> dict:
    """TransformerConfig RoPE-scaling fields for a HF ``rope_parameters`` / ``rope_scaling`` dict: rope_type
    "llama3" (Llama-3.1) or "linear" (position interpolation); other scalings are refused with one line."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return {}
    if rope_type == "linear":
        return dict(rotary_seq_len_interpolation_factor=float(rope["factor"]))
    if rope_type == "llama3":
        return dict(use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]),
                    rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                    rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                    rope_scaling_original_max_position_embeddings=int(
                        rope.get("original_max_position_embeddings") or max_position_embeddings))
    raise ValueError(f"rope_type {rope_type!r} (RoPE scaling) is not supported; default, llama3 and linear are")


def hf_rope_scaling(config: TransformerConfig) -> Optional[dict]:
    """The HF ``rope_scaling`` dict of `config`'s RoPE scaling (None without scaling); both at once has no HF form."""
    factor = config.rotary_seq_len_interpolation_factor
    if config.use_rope_scaling and factor is not None:
        raise ValueError("--use-rope-scaling together with --rotary-seq-len-interpolation-factor has no Hugging Face "
                         "rope_scaling form (it holds one rope_type); keep one")
    if factor is not None:
        return {"rope_type": "linear", "factor": float(factor)}
    if config.use_rope_scaling:
        return {"rope_type": "llama3", "factor": float(config.rope_scaling_factor),
                "low_freq_factor": float(config.rope_scaling_low_freq_factor),
                "high_freq_factor": float(config.rope_scaling_high_freq_factor),
                "original_max_position_embeddings": int(config.rope_scaling_original_max_position_embeddings)}
    return None


def hf_llama_config_kwargs(config: TransformerConfig, vocab_size: Optional[int] = None) -> dict:
    """Keyword arguments for transformers.LlamaConfig (also MistralConfig / Qwen2Config) of the same model."""
    if not (config.swiglu and config.normalization == "RMSNorm" and config.position_embedding_type == "rope"):
        raise ValueError("a Llama-family model needs --swiglu --normalization RMSNorm --position-embedding-type rope")
    if config.add_bias_linear or config.rotary_percent != 1.0 or config.apply_residual_connection_post_layernorm:
        raise ValueError("Llama-family HF models have no linear biases (except Qwen2's qkv), full RoPE, pre-norm")
    return dict(
        vocab_size=vocab_size or config.padded_vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layernorm_epsilon, rope_theta=config.rotary_base, hidden_act="silu",
        tie_word_embeddings=config.share_embeddings_and_output_weights, attention_dropout=config.attention_dropout,
        rope_scaling=hf_rope_scaling(config),
    )
