"""The Llama family (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`) <-> Megatron
GPT: the weight and config mapping (TP=1 state dicts, reused by the checkpoint tools) and the Hugging Face adapter (registry line LLAMA).

Megatron-LM's layouts: query_key_value is grouped per KV group ``[q of the group's heads; k; v]`` (HF q/k/v_proj need
no RoPE permutation: both use the half-split convention), dense_h_to_4h is ``[gate_proj; up_proj]``, norms are RMSNorm
weights, the output layer is untied (``output_layer.weight``), ``rope_theta`` is --rotary-base. The attention and
norm halves of a layer (`layer_from_hf`, `layer_to_hf`) take the layer's MLP tensors as an argument, so the MoE
members (hf_moe.py) reuse them with their experts. Qwen3's per-head ``q_norm`` / ``k_norm`` are --qk-layernorm's
``self_attention.q_layernorm`` / ``k_layernorm``. HF's ``sliding_window`` S (S keys: the query and S - 1 before it)
is --window-size S-1,0; Qwen2/Qwen3's ``layer_types`` (from ``use_sliding_window`` / ``max_window_layers``) give
--window-attn-skip-freq as a 0/1 list (Mistral: every layer).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

import torch

from megatron.checkpoint.conversion.hf_decoder import (
    AddTensor,
    Checked,
    DecoderMapping,
    heads,
    read_decoder,
    write_decoder,
)
from megatron.checkpoint.conversion.interchange import (
    EMBEDDINGS,
    FINAL_NORM,
    OUTPUT_LAYER,
    ConversionError,
    Message,
    ModelMeta,
    architecture_of,
    layer_message,
)
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.layers.rotary import YarnScaling, yarn_concentration, yarn_get_mscale, yarn_scaling_of
from megatron.models.hf_adapter import HFAdapter
from megatron.models.hf_common import ENC as _ENC
from megatron.models.hf_common import LM as _LM
from megatron.models.hf_common import encoder_layer_count, hf_config_class, hf_config_object, pad_rows

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
QK_NORMS = (("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"))
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
        for m_name, h_name in _LLAMA_LAYER_MAP + ([*QK_NORMS] if config.qk_layernorm else []):
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
    for i in range(encoder_layer_count(flat)):
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
        for m_name, h_name in _LLAMA_LAYER_MAP + ([*QK_NORMS] if config.qk_layernorm else []):
            out[dst + h_name] = flat[src + m_name]
    out["model.norm.weight"] = flat[_ENC + "final_layernorm.weight"]
    out["lm_head.weight"] = flat.get(_LM + "output_layer.weight", flat[need])[rows]
    return out


def megatron_config_from_hf_llama(hf_config: Any, **overrides: Any) -> TransformerConfig:
    """A TransformerConfig for a HF LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config (dropouts 0;
    `overrides` win): Qwen2 gets the QKV bias, Qwen3 --qk-layernorm (and its attention_bias), a sliding window
    --window-size (`window_fields_from_hf`)."""
    model_type = getattr(hf_config, "model_type", "llama")
    qwen3 = model_type.startswith("qwen3")
    if (getattr(hf_config, "attention_bias", False) and not qwen3) or getattr(hf_config, "mlp_bias", False):
        raise ValueError("Llama configs with attention_bias / mlp_bias are not supported")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r}: only SwiGLU (silu) Llama-family MLPs map to --swiglu")
    kwargs = llama_config_fields(hf_config)
    kwargs.update(add_qkv_bias=model_type == "qwen2" or (qwen3 and bool(getattr(hf_config, "attention_bias", False))),
                  qk_layernorm=qwen3, **window_fields_from_hf(hf_config))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def llama_config_fields(hf_config: Any) -> dict:
    """The TransformerConfig fields every Llama-family member shares (sizes, RMSNorm, SwiGLU, RoPE, GQA, tying)."""
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=heads,
        kv_channels=head_dim, ffn_hidden_size=hf_config.intermediate_size,
        max_position_embeddings=hf_config.max_position_embeddings, padded_vocab_size=hf_config.vocab_size,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=hf_config.rms_norm_eps,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope", rotary_base=float(theta),
        group_query_attention=groups != heads, num_query_groups=groups if groups != heads else None,
        add_bias_linear=False, bias_gelu_fusion=False,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **rope_scaling_fields_from_hf(rope, hf_config.max_position_embeddings),
    )


def window_fields_from_hf(hf_config: Any) -> dict:
    """window_size / window_attn_skip_freq of a HF config's sliding window: ``sliding_window`` S (None: global;
    Qwen2/Qwen3 set it only with ``use_sliding_window``) on the layers ``layer_types`` names "sliding_attention"
    (every layer when the config has no layer_types, as Mistral and Qwen3-MoE)."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None or getattr(hf_config, "use_sliding_window", None) is False:
        return {}  # Qwen2-MoE keeps sliding_window 0 without use_sliding_window
    if window < 1:
        raise ValueError(f"sliding_window {window}: must be >= 1")
    types = getattr(hf_config, "layer_types", None) if hf_config.model_type != "mistral" else None
    pattern = [int(t == "sliding_attention") for t in types] if types else [1] * hf_config.num_hidden_layers
    if not any(pattern):
        return {}
    return dict(window_size=(int(window) - 1, 0), window_attn_skip_freq=None if all(pattern) else pattern)


def hf_window_kwargs(config: TransformerConfig, name: str) -> dict:
    """The HF config keyword arguments of `config`'s sliding window for architecture `name` (no window: Mistral's
    ``sliding_window`` None, nothing for the others)."""
    if not config.window_size:
        return {"sliding_window": None} if name == "MistralForCausalLM" else {}
    window = config.window_size[0] + 1
    pattern = [int(config.is_window_layer(i + 1)) for i in range(config.num_layers)]
    if name in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        if not all(pattern):
            raise ValueError(f"{name} slides its window on every layer: --window-attn-skip-freq has no form there")
        return {"sliding_window": window} if name != "Qwen3MoeForCausalLM" else {"use_sliding_window": True,
                                                                                 "sliding_window": window}
    if name in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        return {"use_sliding_window": True, "sliding_window": window,
                "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern]}
    raise ValueError(f"{name} has no sliding-window attention (--window-size): export it as MistralForCausalLM, "
                     "Qwen2ForCausalLM or Qwen3ForCausalLM")


def rope_scaling_fields_from_hf(rope: Mapping[str, Any], max_position_embeddings: int) -> dict:
    """TransformerConfig RoPE-scaling fields for a HF ``rope_parameters`` / ``rope_scaling`` dict: rope_type
    "llama3" (Llama-3.1), "linear" (position interpolation) or "yarn"; other scalings are refused with one line."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return {}
    if rope_type == "yarn":
        return yarn_fields_from_hf(rope, max_position_embeddings)
    if rope_type == "linear":
        return dict(rotary_seq_len_interpolation_factor=float(rope["factor"]))
    if rope_type == "llama3":
        return dict(use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]),
                    rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                    rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                    rope_scaling_original_max_position_embeddings=int(
                        rope.get("original_max_position_embeddings") or max_position_embeddings))
    raise ValueError(f"rope_type {rope_type!r} (RoPE scaling) is not supported; default, llama3, linear and yarn are")


def yarn_fields_from_hf(rope: Mapping[str, Any], max_position_embeddings: int) -> dict:
    """TransformerConfig YaRN fields for HF rope parameters of rope_type "yarn", read as transformers reads them
    (`_compute_yarn_parameters`): factor (else max_position_embeddings / original), beta_fast/slow (else 32/1),
    truncate, and mscale/mscale_all_dim only when both are set (else transformers uses mscale(factor) alone). An
    explicit attention_factor is accepted when it equals the one these give (one line naming it otherwise)."""
    original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    factor = float(rope.get("factor") or max_position_embeddings / original)
    both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))
    fields = dict(rope_type="yarn", rotary_scaling_factor=factor, original_max_position_embeddings=original,
                  beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                  mscale=float(rope["mscale"]) if both else 1.0,
                  mscale_all_dim=float(rope["mscale_all_dim"]) if both else 0.0,
                  yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))
    given = rope.get("attention_factor")
    if given is not None:
        ours = yarn_concentration(YarnScaling(factor, original, mscale=fields["mscale"],
                                              mscale_all_dim=fields["mscale_all_dim"]))
        if float(given) != ours:
            raise ValueError(f"rope_scaling attention_factor {given} differs from YaRN's mscale of factor {factor} "
                             f"({ours}); Megatron-LM has no flag for another value: drop the field to use {ours}")
    return fields


def hf_yarn_rope_scaling(config: TransformerConfig) -> dict:
    """The HF rope parameters of `config`'s YaRN (rope_type "yarn"), read back by transformers as the same
    frequencies and concentration (attention_factor written only where transformers' own would differ)."""
    scaling = YarnScaling(config.rotary_scaling_factor, config.original_max_position_embeddings, config.beta_fast,
                          config.beta_slow, config.mscale, config.mscale_all_dim,
                          config.yarn_correction_range_round_to_int)
    out = {"rope_type": "yarn", "factor": float(scaling.factor),
           "original_max_position_embeddings": int(scaling.original_max_position_embeddings),
           "beta_fast": float(scaling.beta_fast), "beta_slow": float(scaling.beta_slow),
           "truncate": bool(scaling.round_to_int)}
    if scaling.mscale and scaling.mscale_all_dim:
        out.update(mscale=float(scaling.mscale), mscale_all_dim=float(scaling.mscale_all_dim))
    elif yarn_concentration(scaling) != yarn_get_mscale(scaling.factor):
        out["attention_factor"] = yarn_concentration(scaling)
    return out


def hf_rope_scaling(config: TransformerConfig) -> Optional[dict]:
    """The HF ``rope_scaling`` dict of `config`'s RoPE scaling (None without scaling); both at once has no HF form."""
    factor = config.rotary_seq_len_interpolation_factor
    if yarn_scaling_of(config) is not None:
        return hf_yarn_rope_scaling(config)
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


# ----------------------------------------------------------------------------------------------- adapter
def config_reader(reader: Callable[[Any], TransformerConfig]) -> Callable[[str, Dict[str, Any]], Dict[str, Any]]:
    """The adapter's config half for a family member: `reader(transformers config)`'s architecture fields, its
    refusals as one line naming the folder."""
    def config_from_hf(load_dir: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
        hf_config = hf_config_object(load_dir)
        try:
            config = reader(hf_config)
        except ValueError as exc:
            raise ConversionError(f"{load_dir}: {exc}") from None
        return architecture_of(config)

    return config_from_hf


def layer_from_hf(t: Any, src: str, meta: ModelMeta,
                  mlp: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """One layer's Megatron tensors from the HF names under `src` ("model.layers.{i}."): attention and norms, and as
    the MLP either `mlp` (an MoE member's tensors) or, when None, the dense SwiGLU MLP."""
    nq, ng, hd = heads(meta)
    attn = src + "self_attn."
    out = {"self_attention.query_key_value.weight": qkv_pack_groups(
        t.get(attn + "q_proj.weight"), t.get(attn + "k_proj.weight"), t.get(attn + "v_proj.weight"), nq, ng, hd)}
    if attn + "q_proj.bias" in t:
        out["self_attention.query_key_value.bias"] = qkv_pack_groups(
            t.get(attn + "q_proj.bias"), t.get(attn + "k_proj.bias"), t.get(attn + "v_proj.bias"), nq, ng, hd)
    if meta.architecture.get("qk_layernorm"):
        for m_name, h_name in QK_NORMS:
            out[m_name] = t.get(src + h_name)
    if mlp is None:
        out["mlp.dense_h_to_4h.weight"] = torch.cat([t.get(src + "mlp.gate_proj.weight"),
                                                     t.get(src + "mlp.up_proj.weight")], dim=0)
    else:
        out.update(mlp)
    for m_name, h_name in _LLAMA_LAYER_MAP:
        if mlp is None or not m_name.startswith("mlp."):
            out[m_name] = t.get(src + h_name)
    return out


def stream_from_hf(t: Any, meta: ModelMeta,
                   mlp_of: Callable[[int, str], Optional[Dict[str, torch.Tensor]]]) -> Iterator[Message]:
    """The message stream of a Llama-family folder; `mlp_of(i, "model.layers.{i}.")` gives layer i's MLP tensors
    (None: the dense MLP)."""
    yield Message(EMBEDDINGS, {"word_embeddings.weight": t.get("model.embed_tokens.weight")})
    for i in range(meta.architecture["num_layers"]):
        src = f"model.layers.{i}."
        yield Message(layer_message(i), layer_from_hf(t, src, meta, mlp_of(i, src)))
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get("model.norm.weight")})
    if not meta.architecture["share_embeddings_and_output_weights"]:
        head = "lm_head.weight" if "lm_head.weight" in t else "model.embed_tokens.weight"
        yield Message(OUTPUT_LAYER, {"output_layer.weight": t.get(head)})


def _llama_stream(t: Any, meta: ModelMeta) -> Iterator[Message]:
    yield from stream_from_hf(t, meta, lambda i, src: None)


def hf_llama_architecture(config: TransformerConfig) -> str:
    """The HF architecture a Llama-family `config` exports as by default: Qwen3 with --qk-layernorm, Qwen2 with the
    QKV bias or a window on some layers only, Mistral with a window on every layer, else Llama."""
    if config.qk_layernorm:
        return "Qwen3ForCausalLM"
    if config.add_qkv_bias:
        return "Qwen2ForCausalLM"
    if config.window_size:
        every = all(config.is_window_layer(i + 1) for i in range(config.num_layers))
        return "MistralForCausalLM" if every else "Qwen2ForCausalLM"
    return "LlamaForCausalLM"


def _llama_config_to_hf(config: TransformerConfig, rows: int, arch_name: Optional[str]) -> Any:
    kwargs = hf_llama_config_kwargs(config, vocab_size=rows)
    name = arch_name or hf_llama_architecture(config)
    if config.qk_layernorm and name != "Qwen3ForCausalLM":
        raise ValueError("per-head q/k norms (--qk-layernorm) exist only in Qwen3ForCausalLM")
    if config.add_qkv_bias and name not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        raise ValueError("a QKV bias (--add-qkv-bias) exists only in Qwen2ForCausalLM (and Qwen3's attention_bias)")
    if name == "Qwen3ForCausalLM":
        kwargs["attention_bias"] = bool(config.add_qkv_bias)
    kwargs.update(hf_window_kwargs(config, name))
    cls = hf_config_class(name.replace("ForCausalLM", "Config"))
    hf = cls(**kwargs)
    hf.architectures = [name]
    return hf


def embeddings_to_hf(add: AddTensor, emb: Checked, word: torch.Tensor) -> None:
    """The saver's embeddings half (Llama-family names)."""
    add("model.embed_tokens.weight", word)


def layer_to_hf(add: AddTensor, dst: str, layer: Checked, meta: ModelMeta,
                mlp: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Inverse of `layer_from_hf`: `mlp` holds the MoE member's HF MLP tensors (None: the dense MLP's)."""
    nq, ng, hd = heads(meta)
    q, k, v = qkv_unpack_groups(layer["self_attention.query_key_value.weight"], nq, ng, hd)
    add(dst + "self_attn.q_proj.weight", q)
    add(dst + "self_attn.k_proj.weight", k)
    add(dst + "self_attn.v_proj.weight", v)
    if "self_attention.query_key_value.bias" in layer:
        q, k, v = qkv_unpack_groups(layer["self_attention.query_key_value.bias"], nq, ng, hd)
        add(dst + "self_attn.q_proj.bias", q)
        add(dst + "self_attn.k_proj.bias", k)
        add(dst + "self_attn.v_proj.bias", v)
    if meta.architecture.get("qk_layernorm"):
        for m_name, h_name in QK_NORMS:
            add(dst + h_name, layer[m_name])
    if mlp is None:
        gate, up = layer["mlp.dense_h_to_4h.weight"].chunk(2, dim=0)
        add(dst + "mlp.gate_proj.weight", gate.contiguous())
        add(dst + "mlp.up_proj.weight", up.contiguous())
    else:
        for name, tensor in mlp.items():
            add(name, tensor)
    for m_name, h_name in _LLAMA_LAYER_MAP:
        if mlp is None or not m_name.startswith("mlp."):
            add(dst + h_name, layer[m_name])


def _llama_layer_to_hf(add: AddTensor, i: int, layer: Checked, meta: ModelMeta, hf_config: Any) -> None:
    layer_to_hf(add, f"model.layers.{i}.", layer, meta)


def final_norm_to_hf(add: AddTensor, norm: Checked) -> None:
    """The saver's final-norm half (Llama-family names)."""
    add("model.norm.weight", norm["final_layernorm.weight"])


def llama_shaped(a: Dict[str, Any]) -> bool:
    """Whether stored architecture fields are a Llama-family model's (SwiGLU, RMSNorm, RoPE)."""
    return bool(a.get("swiglu")) and a.get("normalization") == "RMSNorm" and a.get("position_embedding_type") == "rope"


_LLAMA = DecoderMapping(config_from_hf=config_reader(megatron_config_from_hf_llama), weights_from_hf=_llama_stream,
                        config_to_hf=_llama_config_to_hf, embeddings_to_hf=embeddings_to_hf,
                        layer_to_hf=_llama_layer_to_hf, final_norm_to_hf=final_norm_to_hf)
LLAMA = HFAdapter(name="llama", model_type="GPT", architectures=ARCHITECTURES,
                  read=partial(read_decoder, _LLAMA), write=partial(write_decoder, _LLAMA),
                  accepts=lambda a: llama_shaped(a) and not a.get("num_moe_experts"),
                  description="Llama-family (--swiglu --normalization RMSNorm --position-embedding-type rope)")
