"""GPT-OSS (`GptOssForCausalLM`) <-> Megatron GPT: the config and weight mapping and the Hugging Face adapter
(registry line GPT_OSS).

The model is a Llama-shaped decoder (RMSNorm, RoPE half-split, grouped-query attention) with Megatron-LM core's
GPT-OSS parts (issue #38): linear biases everywhere (--add-bias-linear: q/k/v/o, the router, the experts), attention
sinks (--softmax-type learnable: ``self_attn.sinks`` [heads] = ``self_attention.core_attention.softmax_offset``), an
MoE MLP in every layer whose router takes softmax over the top-k logits (Megatron's default) and whose experts apply
the clamped GLU (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value ``swiglu_limit``).

Tensors: ``mlp.router.weight`` [E, h] / ``.bias`` [E] = ours; ``mlp.experts.gate_up_proj`` [E, h, 2F] holds gate
and up **interleaved** by column (gate = columns 0::2, up = 1::2; ``gate_up_proj_bias`` [E, 2F] likewise), ours
``mlp.experts.weight1`` [E, h, 2F] / ``bias1`` hold [gate | up]; ``down_proj`` [E, F, h] / ``down_proj_bias`` [E, h]
are ``weight2`` / ``bias2`` as they are.

The published checkpoints pack the experts' matrices as MXFP4 (``quantization_config`` quant_method "mxfp4":
``gate_up_proj_blocks`` [E, 2F, h/32, 16] uint8, two FP4 e2m1 values a byte, low nibble first, and
``gate_up_proj_scales`` [E, 2F, h/32] uint8 exponents biased by 127, one per 32 values; ``down_proj`` likewise
[E, h, F/32, ...]): they are dequantised on load (`dequantize_mxfp4`, exact in bf16) into the [E, in, out] matrices;
the biases and every other tensor are stored unpacked. A save writes them unpacked (bf16/fp32).

``layer_types`` / ``sliding_window`` S give --window-size S-1,0 on the "sliding_attention" layers
(--window-attn-skip-freq as a 0/1 list; hf_llama's `window_fields_from_hf`), and back.

Refused with one line (the field named): RoPE scalings other
than default/llama3/linear/yarn (hf_llama's), ``swiglu_alpha`` other than 1.702 (Megatron's quick GeLU), other quantisation
methods.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Dict, Iterator, Optional

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
from megatron.models.gpt.hf_llama import (
    embeddings_to_hf,
    final_norm_to_hf,
    hf_rope_scaling,
    qkv_pack_groups,
    qkv_unpack_groups,
    rope_scaling_fields_from_hf,
    window_fields_from_hf,
)
from megatron.models.hf_adapter import HFAdapter
from megatron.models.hf_common import hf_config_class, hf_config_object

ARCHITECTURES = ("GptOssForCausalLM",)
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
QUICK_GELU_ALPHA = 1.702  # Megatron-LM core's quick_gelu gain
# (ours inside a layer, HF's inside "model.layers.{i}.") for tensors that map as they are
_PLAIN = (("input_layernorm.weight", "input_layernorm.weight"),
          ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
          ("self_attention.dense.weight", "self_attn.o_proj.weight"),
          ("self_attention.dense.bias", "self_attn.o_proj.bias"),
          ("self_attention.core_attention.softmax_offset", "self_attn.sinks"),
          ("mlp.router.weight", "mlp.router.weight"), ("mlp.router.bias", "mlp.router.bias"),
          ("mlp.experts.weight2", "mlp.experts.down_proj"), ("mlp.experts.bias2", "mlp.experts.down_proj_bias"))
_GATE_UP = (("mlp.experts.weight1", "mlp.experts.gate_up_proj"), ("mlp.experts.bias1", "mlp.experts.gate_up_proj_bias"))


def deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """HF's interleaved gate/up columns (last dim: g0 u0 g1 u1 ...) -> ours [gate | up]."""
    return torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).contiguous()


def interleave(gate_up: torch.Tensor) -> torch.Tensor:
    """Inverse of `deinterleave`: ours [gate | up] -> HF's interleaved columns."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).reshape(gate_up.shape).contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 ``*_blocks`` [E, rows, G, 16] uint8 and ``*_scales`` [E, rows, G] uint8 -> [E, G * 32, rows] of `dtype`
    (value = FP4 e2m1 code x 2^(scale - 127), low nibble first; transposed to our input-major layout)."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [E, rows, G, 16, 2]
    values = lut[codes].flatten(-2)  # [E, rows, G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).transpose(1, 2).contiguous().to(dtype)


def _refusals(hf_config: Any) -> None:
    quant = getattr(hf_config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        if method != "mxfp4":
            raise ValueError(f"quantization_config quant_method {method!r}: only the published MXFP4 packing of "
                             "the experts is read; dequantise the checkpoint first")
    alpha = float(getattr(hf_config, "swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        raise ValueError(f"swiglu_alpha {alpha}: Megatron's --quick-geglu has gain {QUICK_GELU_ALPHA}")
    if not getattr(hf_config, "attention_bias", True):
        raise ValueError("attention_bias False: GPT-OSS's biases come with --add-bias-linear on every linear")


def megatron_config_from_hf_gpt_oss(hf_config: Any, **overrides: Any) -> TransformerConfig:
    """A TransformerConfig for a HF GptOssConfig (dropouts 0; `overrides` win); refusals as one-line ValueErrors."""
    _refusals(hf_config)
    heads_ = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads_
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 150000.0))
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=heads_,
        kv_channels=hf_config.head_dim, ffn_hidden_size=hf_config.intermediate_size,
        max_position_embeddings=hf_config.max_position_embeddings, padded_vocab_size=hf_config.vocab_size,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=hf_config.rms_norm_eps,
        normalization="RMSNorm", position_embedding_type="rope", rotary_base=float(theta),
        group_query_attention=groups != heads_, num_query_groups=groups if groups != heads_ else None,
        add_bias_linear=True, softmax_type="learnable", quick_geglu=True, glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf_config.swiglu_limit), num_moe_experts=hf_config.num_local_experts,
        moe_router_topk=hf_config.num_experts_per_tok, moe_ffn_hidden_size=hf_config.intermediate_size,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **rope_scaling_fields_from_hf(rope, hf_config.max_position_embeddings), **window_fields_from_hf(hf_config),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gpt_oss_shaped(a: Dict[str, Any]) -> bool:
    """Whether stored architecture fields are a GPT-OSS model's (sinks, clamped quick GeGLU experts, biases)."""
    return (a.get("softmax_type") == "learnable" and bool(a.get("quick_geglu")) and bool(a.get("num_moe_experts"))
            and a.get("normalization") == "RMSNorm" and a.get("position_embedding_type") == "rope")


def hf_gpt_oss_config_kwargs(config: TransformerConfig, vocab_size: int) -> Dict[str, Any]:
    """Keyword arguments of transformers.GptOssConfig for this model (one-line ValueErrors for what it cannot hold)."""
    if not (config.add_bias_linear and config.glu_linear_offset == 1.0 and config.activation_func_clamp_value
            and config.moe_ffn_hidden_size == config.ffn_hidden_size and all(config.moe_layer_pattern)):
        raise ValueError("GptOssForCausalLM needs --add-bias-linear, --glu-linear-offset 1, "
                         "--activation-func-clamp-value, an MoE MLP in every layer and --moe-ffn-hidden-size = "
                         "--ffn-hidden-size")
    if config.moe_router_pre_softmax or config.moe_router_score_function != "softmax" or \
            config.moe_router_topk_scaling_factor or config.moe_shared_expert_intermediate_size:
        raise ValueError("GptOssForCausalLM routes with softmax over the top-k logits, no scaling, no shared expert")
    return dict(
        vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.moe_ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
        num_local_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
        swiglu_limit=float(config.activation_func_clamp_value), tie_word_embeddings=config.share_embeddings_and_output_weights,
        rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base, **(hf_rope_scaling(config) or {})},
        attention_bias=True, **_hf_window(config),
    )


def _hf_window(config: TransformerConfig) -> Dict[str, Any]:
    """GptOssConfig's layer_types / sliding_window of --window-size W,0 (S = W + 1 keys) on the layers
    --window-attn-skip-freq picks; all layers full without a window."""
    if not config.window_size:
        return dict(layer_types=["full_attention"] * config.num_layers, sliding_window=config.max_position_embeddings)
    return dict(sliding_window=config.window_size[0] + 1,
                layer_types=["sliding_attention" if config.is_window_layer(i + 1) else "full_attention"
                             for i in range(config.num_layers)])


# ----------------------------------------------------------------------------------------------- adapter
def _config_from_hf(load_dir: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    try:
        return architecture_of(megatron_config_from_hf_gpt_oss(hf_config_object(load_dir)))
    except ValueError as exc:
        raise ConversionError(f"{load_dir}: {exc}") from None


def _expert_matrix(t: Any, name: str) -> torch.Tensor:
    """An experts' matrix [E, in, out] in HF's layout: stored as it is, or MXFP4-packed (dequantised to the dtype
    of its bias)."""
    if name in t:
        return t.get(name)
    return dequantize_mxfp4(t.get(name + "_blocks"), t.get(name + "_scales"), t.get(name + "_bias").dtype)


def _layer_from_hf(t: Any, src: str, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    nq, ng, hd = heads(meta)
    attn = src + "self_attn."
    out = {f"self_attention.query_key_value.{kind}": qkv_pack_groups(
        t.get(f"{attn}q_proj.{kind}"), t.get(f"{attn}k_proj.{kind}"), t.get(f"{attn}v_proj.{kind}"), nq, ng, hd)
        for kind in ("weight", "bias")}
    out.update({ours: t.get(src + theirs) for ours, theirs in _PLAIN if ours != "mlp.experts.weight2"})
    out["mlp.experts.weight2"] = _expert_matrix(t, src + "mlp.experts.down_proj")
    out["mlp.experts.weight1"] = deinterleave(_expert_matrix(t, src + "mlp.experts.gate_up_proj"))
    out["mlp.experts.bias1"] = deinterleave(t.get(src + "mlp.experts.gate_up_proj_bias"))
    return out


def _stream(t: Any, meta: ModelMeta) -> Iterator[Message]:
    yield Message(EMBEDDINGS, {"word_embeddings.weight": t.get("model.embed_tokens.weight")})
    for i in range(meta.architecture["num_layers"]):
        yield Message(layer_message(i), _layer_from_hf(t, f"model.layers.{i}.", meta))
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get("model.norm.weight")})
    if not meta.architecture["share_embeddings_and_output_weights"]:
        yield Message(OUTPUT_LAYER, {"output_layer.weight": t.get("lm_head.weight")})


def _config_to_hf(config: TransformerConfig, rows: int, arch_name: Optional[str]) -> Any:
    if arch_name not in (None, *ARCHITECTURES):
        raise ValueError(f"--hf-architecture {arch_name}: a GPT-OSS model is written as GptOssForCausalLM")
    hf = hf_config_class("GptOssConfig")(**hf_gpt_oss_config_kwargs(config, rows))
    hf.architectures = list(ARCHITECTURES)
    return hf


def _layer_to_hf(add: AddTensor, i: int, layer: Checked, meta: ModelMeta, hf_config: Any) -> None:
    dst = f"model.layers.{i}."
    nq, ng, hd = heads(meta)
    for kind in ("weight", "bias"):
        q, k, v = qkv_unpack_groups(layer[f"self_attention.query_key_value.{kind}"], nq, ng, hd)
        for name, tensor in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            add(f"{dst}self_attn.{name}.{kind}", tensor)
    for ours, theirs in _PLAIN:
        add(dst + theirs, layer[ours])
    for ours, theirs in _GATE_UP:
        add(dst + theirs, interleave(layer[ours]))


_GPT_OSS = DecoderMapping(config_from_hf=_config_from_hf, weights_from_hf=_stream, config_to_hf=_config_to_hf,
                          embeddings_to_hf=embeddings_to_hf, layer_to_hf=_layer_to_hf,
                          final_norm_to_hf=final_norm_to_hf)
GPT_OSS = HFAdapter(name="gpt_oss", model_type="GPT", architectures=ARCHITECTURES,
                    read=partial(read_decoder, _GPT_OSS), write=partial(write_decoder, _GPT_OSS),
                    accepts=gpt_oss_shaped,
                    description="GPT-OSS (--softmax-type learnable --quick-geglu with experts, RMSNorm, RoPE)")
