"""The Llama family's mixture-of-experts members (`MixtralForCausalLM`, `Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`)
<-> Megatron GPT: the
MoE MLPs between our layout and Hugging Face's Hub layout (safetensors on disk), and the Hugging Face adapter
(registry line MOE).

`MixtralForCausalLM`: ``block_sparse_moe.gate.weight`` [E, h] = ``mlp.router.weight``; expert j's ``w1`` (gate),
``w3`` (up) [F, h] and ``w2`` (down) [h, F] = ``mlp.experts.weight1[j]`` = [gate; up]^T [h, 2F] and
``mlp.experts.weight2[j]`` = down^T [F, h]. Routing: softmax, top-k, renormalise = top-k over the logits then softmax
(Megatron's default). `Qwen2MoeForCausalLM`: ``mlp.gate.weight``, ``mlp.experts.{j}.gate_proj/up_proj/down_proj``,
``mlp.shared_expert.*`` (a SwiGLU MLP: ``mlp.shared_experts.dense_h_to_4h`` = [gate; up], ``dense_4h_to_h``) and
``mlp.shared_expert_gate.weight`` [1, h] = ``mlp.shared_experts.gate_weight``; routing is softmax then top-k
(--moe-router-pre-softmax), renormalised only with ``norm_topk_prob``; ``decoder_sparse_step`` / ``mlp_only_layers``
give --moe-layer-freq as a list; the QKV has a bias. `Qwen3MoeForCausalLM`: Qwen2-MoE's expert names and routing
without a shared expert or a QKV bias (``attention_bias``), with Qwen3's per-head q/k norms (--qk-layernorm).
Attention, norms and the dense layers map as for Llama (hf_llama.py).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

import torch

from megatron.checkpoint.conversion.hf_decoder import AddTensor, Checked, DecoderMapping, read_decoder, write_decoder
from megatron.checkpoint.conversion.interchange import Message, ModelMeta
from megatron.core.transformer_config import TransformerConfig
from megatron.models.gpt import hf_llama
from megatron.models.gpt.hf_llama import megatron_config_from_hf_llama
from megatron.models.hf_adapter import HFAdapter
from megatron.models.hf_common import hf_config_class

MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
ROUTER, W1, W2 = "mlp.router.weight", "mlp.experts.weight1", "mlp.experts.weight2"
SHARED_FC1, SHARED_FC2 = "mlp.shared_experts.dense_h_to_4h.weight", "mlp.shared_experts.dense_4h_to_h.weight"
SHARED_GATE = "mlp.shared_experts.gate_weight"


def _mixtral_fields(hf_config: Any) -> Dict[str, Any]:
    return dict(num_moe_experts=hf_config.num_local_experts, moe_router_topk=hf_config.num_experts_per_tok,
                moe_ffn_hidden_size=hf_config.intermediate_size)


def _qwen2_moe_fields(hf_config: Any) -> Dict[str, Any]:
    layers = hf_config.num_hidden_layers
    only_dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    pattern = [int(i not in only_dense and (i + 1) % step == 0) for i in range(layers)]
    moe = dict(num_moe_experts=hf_config.num_experts, moe_router_topk=hf_config.num_experts_per_tok,
               moe_ffn_hidden_size=hf_config.moe_intermediate_size, moe_layer_freq=pattern,
               moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", False),
               add_qkv_bias=bool(getattr(hf_config, "qkv_bias", True)))
    shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
    if shared:
        moe.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return moe


def _qwen3_moe_fields(hf_config: Any) -> Dict[str, Any]:
    """Qwen2-MoE's routing and layer pattern; no shared expert, the QKV bias is Qwen3's attention_bias."""
    moe = _qwen2_moe_fields(hf_config)
    moe["add_qkv_bias"] = bool(getattr(hf_config, "attention_bias", False))
    return moe


# HF config.model_type -> the MoE fields of its config (on top of the Llama ones)
MOE_FIELDS: Dict[str, Callable[[Any], Dict[str, Any]]] = {"mixtral": _mixtral_fields,
                                                          "qwen2_moe": _qwen2_moe_fields,
                                                          "qwen3_moe": _qwen3_moe_fields}


def megatron_config_from_hf_moe(hf_config: Any, **overrides: Any) -> TransformerConfig:
    """A TransformerConfig for a HF MixtralConfig / Qwen2MoeConfig (dropouts 0; `overrides` win)."""
    model_type = getattr(hf_config, "model_type", "")
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise ValueError("router_jitter_noise > 0 (input jitter) is not supported")
    if model_type not in MOE_FIELDS:
        raise ValueError(f"model_type {model_type!r} is not a supported MoE family ({', '.join(MOE_FIELDS)})")
    return megatron_config_from_hf_llama(hf_config, **{**MOE_FIELDS[model_type](hf_config), **overrides})


def hf_moe_arch(config: TransformerConfig) -> str:
    """The HF architecture holding this MoE model: Qwen3-MoE with --qk-layernorm, Qwen2-MoE for a shared expert or a
    QKV bias, else Mixtral."""
    if config.qk_layernorm:
        return "Qwen3MoeForCausalLM"
    if config.moe_shared_expert_intermediate_size or config.add_qkv_bias or config.moe_router_pre_softmax:
        return "Qwen2MoeForCausalLM"
    return "MixtralForCausalLM"


def hf_moe_config_kwargs(config: TransformerConfig, arch: str) -> Dict[str, Any]:
    """Extra keyword arguments of MixtralConfig / Qwen2MoeConfig for this model (on top of the Llama ones)."""
    if config.moe_router_score_function != "softmax" or config.moe_router_topk_scaling_factor or \
            config.moe_expert_capacity_factor is not None:
        raise ValueError("HF MoE models route with softmax, no scaling factor and no capacity dropping")
    if arch == "MixtralForCausalLM":
        if config.moe_router_pre_softmax or config.moe_shared_expert_intermediate_size or \
                any(v == 0 for v in config.moe_layer_pattern):
            raise ValueError("Mixtral has MoE in every layer, no shared expert, top-k then softmax routing")
        return dict(num_local_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
                    intermediate_size=config.moe_ffn_hidden_size, **hf_llama.hf_window_kwargs(config, arch))
    pattern = config.moe_layer_pattern
    if arch == "Qwen3MoeForCausalLM":
        if config.moe_shared_expert_intermediate_size or not config.qk_layernorm:
            raise ValueError("Qwen3-MoE has per-head q/k norms (--qk-layernorm) and no shared expert")
        return dict(num_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
                    moe_intermediate_size=config.moe_ffn_hidden_size, norm_topk_prob=not config.moe_router_pre_softmax,
                    decoder_sparse_step=1, mlp_only_layers=[i for i, v in enumerate(pattern) if not v],
                    attention_bias=config.add_qkv_bias, **hf_llama.hf_window_kwargs(config, arch))
    if arch != "Qwen2MoeForCausalLM":
        raise ValueError(f"{arch} is not a supported MoE architecture ({', '.join(MOE_ARCHS)})")
    shared = config.moe_shared_expert_intermediate_size or 0
    if shared and not config.moe_shared_expert_gate:
        raise ValueError("Qwen2-MoE's shared expert is gated: the model needs --moe-shared-expert-gate")
    return dict(num_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
                moe_intermediate_size=config.moe_ffn_hidden_size, shared_expert_intermediate_size=shared,
                norm_topk_prob=not config.moe_router_pre_softmax, decoder_sparse_step=1,
                mlp_only_layers=[i for i, v in enumerate(pattern) if not v], qkv_bias=config.add_qkv_bias,
                **(hf_llama.hf_window_kwargs(config, arch) or {"use_sliding_window": False}))


def hf_moe_mlp_to_megatron(get: Callable[[str], torch.Tensor], prefix: str, arch: str,
                           num_experts: int, shared: bool) -> Dict[str, torch.Tensor]:
    """One MoE layer's MLP tensors from the HF Hub layout (`get(name)`; `prefix` = "model.layers.{i}.")."""
    if arch == "MixtralForCausalLM":
        moe, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
        router = get(moe + "gate.weight")
    else:
        moe, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
        router = get(moe + "gate.weight")
    gate_up, down = [], []
    for j in range(num_experts):
        e = f"{moe}experts.{j}."
        gate_up.append(torch.cat([get(e + names[0] + ".weight"), get(e + names[1] + ".weight")], dim=0).t())
        down.append(get(e + names[2] + ".weight").t())
    out = {ROUTER: router, W1: torch.stack(gate_up).contiguous(), W2: torch.stack(down).contiguous()}
    if shared:
        s = prefix + "mlp.shared_expert."
        out[SHARED_FC1] = torch.cat([get(s + "gate_proj.weight"), get(s + "up_proj.weight")], dim=0)
        out[SHARED_FC2] = get(s + "down_proj.weight")
        out[SHARED_GATE] = get(prefix + "mlp.shared_expert_gate.weight")
    return out


def megatron_moe_mlp_to_hf(layer: Mapping[str, torch.Tensor], prefix: str, arch: str) -> Dict[str, torch.Tensor]:
    """Inverse of `hf_moe_mlp_to_megatron`: HF Hub names -> tensors (contiguous copies)."""
    if arch == "MixtralForCausalLM":
        moe, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        moe, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    out = {moe + "gate.weight": layer[ROUTER]}
    w1, w2 = layer[W1], layer[W2]
    for j in range(w1.size(0)):
        e = f"{moe}experts.{j}."
        gate, up = w1[j].t().chunk(2, dim=0)
        out[e + names[0] + ".weight"] = gate.contiguous()
        out[e + names[1] + ".weight"] = up.contiguous()
        out[e + names[2] + ".weight"] = w2[j].t().contiguous()
    if SHARED_FC1 in layer:
        s = prefix + "mlp.shared_expert."
        gate, up = layer[SHARED_FC1].chunk(2, dim=0)
        out[s + "gate_proj.weight"] = gate.contiguous()
        out[s + "up_proj.weight"] = up.contiguous()
        out[s + "down_proj.weight"] = layer[SHARED_FC2]
        out[prefix + "mlp.shared_expert_gate.weight"] = layer[SHARED_GATE]
    return out


# ----------------------------------------------------------------------------------------------- adapter
def _moe_stream(t: Any, meta: ModelMeta) -> Iterator[Message]:
    moe_pattern = meta.config().moe_layer_pattern  # MoE MLP (1) or dense MLP (0) per layer
    shared = bool(meta.architecture.get("moe_shared_expert_intermediate_size"))

    def mlp_of(i: int, src: str) -> Optional[Dict[str, torch.Tensor]]:
        if not moe_pattern[i]:
            return None
        return hf_moe_mlp_to_megatron(t.get, src, meta.extra["hf_architecture"], meta.architecture["num_moe_experts"],
                                      shared)

    yield from hf_llama.stream_from_hf(t, meta, mlp_of)


def _moe_config_to_hf(config: TransformerConfig, rows: int, arch_name: Optional[str]) -> Any:
    kwargs = hf_llama.hf_llama_config_kwargs(config, vocab_size=rows)
    name = arch_name or hf_moe_arch(config)
    kwargs.update(hf_moe_config_kwargs(config, name))
    if name == "Qwen2MoeForCausalLM":
        kwargs.pop("head_dim", None)
    hf = hf_config_class(name.replace("ForCausalLM", "Config"))(**kwargs)
    hf.architectures = [name]
    return hf


def _moe_layer_to_hf(add: AddTensor, i: int, layer: Checked, meta: ModelMeta, hf_config: Any) -> None:
    dst = f"model.layers.{i}."
    mlp = megatron_moe_mlp_to_hf(layer, dst, hf_config.architectures[0]) if ROUTER in layer else None
    hf_llama.layer_to_hf(add, dst, layer, meta, mlp)


_MOE = DecoderMapping(config_from_hf=hf_llama.config_reader(megatron_config_from_hf_moe), weights_from_hf=_moe_stream,
                      config_to_hf=_moe_config_to_hf, embeddings_to_hf=hf_llama.embeddings_to_hf,
                      layer_to_hf=_moe_layer_to_hf, final_norm_to_hf=hf_llama.final_norm_to_hf)
MOE = HFAdapter(name="llama_moe", model_type="GPT", architectures=MOE_ARCHS,
                read=partial(read_decoder, _MOE), write=partial(write_decoder, _MOE),
                accepts=lambda a: hf_llama.llama_shaped(a) and bool(a.get("num_moe_experts")),
                description="Llama-family (--swiglu --normalization RMSNorm --position-embedding-type rope)")
