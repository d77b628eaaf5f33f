"""Hugging Face `DeepseekV3ForCausalLM` <-> the DeepSeek-V3 family (Megatron GPT with multi-latent attention, the
sigmoid group-limited router with its expert bias, shared experts and multi-token prediction): the config and weight
mapping (TP=1 tensors under Megatron Core's names, safetensors in the Hub layout) and the adapter (registry line
DEEPSEEK_V3).

Attention (MLA, Megatron Core's names): ``q_a_proj`` = ``linear_q_down_proj``, ``q_a_layernorm`` = ``q_layernorm``,
``q_b_proj`` = ``linear_q_up_proj`` (without q-lora ``q_proj`` = ``linear_q_proj``), ``kv_a_proj_with_mqa`` [latent;
rope key] = ``linear_kv_down_proj``, ``kv_a_layernorm`` = ``kv_layernorm``, ``kv_b_proj`` [per head: nope key; value]
= ``linear_kv_up_proj``, ``o_proj`` = ``linear_proj``; every tensor is taken as it is: HF's ``rope_interleave``
(DeepSeek's interleaved rope dims) is the layout Megatron's MLA rotates. MLP: the first ``first_k_dense_replace``
layers are dense (``intermediate_size``; --moe-layer-freq as a list), the others MoE: ``mlp.gate.weight`` =
``mlp.router.weight``, ``mlp.gate.e_score_correction_bias`` = ``mlp.router.expert_bias``, expert j's
gate/up/down = ``mlp.experts.weight1[j]`` ([gate; up]^T) / ``weight2[j]`` (down^T), ``mlp.shared_experts.*`` (one
ungated SwiGLU MLP of ``moe_intermediate_size x n_shared_experts``) = ``mlp.shared_experts.dense_h_to_4h`` ([gate;
up]) / ``dense_4h_to_h``. Routing: sigmoid scores, group-limited top-k (HF sums the best 2 scores of a group:
Megatron's top-(k / group_topk), so k / topk_group must be 2 when there are groups), weights renormalised over the k
chosen (``norm_topk_prob``, which Megatron's sigmoid router always does for k > 1) and scaled by
``routed_scaling_factor`` (--moe-router-topk-scaling-factor). YaRN ``rope_parameters`` give --rope-type yarn and its
values.

Multi-token prediction: HF stores MTP module k as decoder layer ``num_hidden_layers + k`` (its model ignores it at
run time) with ``enorm``, ``hnorm``, ``eh_proj`` [h, 2h] (input [enorm(embedding); hnorm(hidden)], Megatron's
order), ``shared_head.norm`` (the block's ``final_layernorm``) and copies of the embedding and output layer
(``embed_tokens``, ``shared_head.head``: Megatron shares the model's own, so they are written as copies and read
only to check they are those copies). The converted model has as many MTP layers as the folder stores.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

import torch

from megatron.checkpoint.conversion.hf_decoder import AddTensor, Checked, DecoderMapping, write_decoder
from megatron.checkpoint.conversion.interchange import (
    EMBEDDINGS,
    FINAL_NORM,
    MTP,
    OUTPUT_LAYER,
    ConversionError,
    Message,
    ModelMeta,
    architecture_of,
    layer_message,
)
from megatron.core.transformer_config import TransformerConfig
from megatron.models.hf_adapter import HFAdapter
from megatron.models.hf_common import hf_config_class, hf_config_object

# Megatron names of one layer's tensors (the keys of a "transformer layer {i}" message)
ATTN = "self_attention."
Q_DOWN, Q_UP, Q_PROJ = ATTN + "linear_q_down_proj.weight", ATTN + "linear_q_up_proj.weight", ATTN + "linear_q_proj.weight"
Q_NORM, KV_NORM = ATTN + "q_layernorm.weight", ATTN + "kv_layernorm.weight"
KV_DOWN, KV_UP = ATTN + "linear_kv_down_proj.weight", ATTN + "linear_kv_up_proj.weight"
O_PROJ = ATTN + "linear_proj.weight"
IN_NORM, POST_NORM = "input_layernorm.weight", "post_attention_layernorm.weight"
FC1, FC2 = "mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight"
ROUTER, EXPERT_BIAS = "mlp.router.weight", "mlp.router.expert_bias"
W1, W2 = "mlp.experts.weight1", "mlp.experts.weight2"
SHARED_FC1, SHARED_FC2 = "mlp.shared_experts.dense_h_to_4h.weight", "mlp.shared_experts.dense_4h_to_h.weight"
# one MTP module's own tensors (Megatron Core's mtp.layers.{k}.*), its transformer layer under TRANSFORMER_LAYER
ENORM, HNORM, EH_PROJ, MTP_NORM = "enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"
TRANSFORMER_LAYER = "transformer_layer."

_ATTN_MAP = ((Q_DOWN, "self_attn.q_a_proj.weight"), (Q_NORM, "self_attn.q_a_layernorm.weight"),
             (Q_UP, "self_attn.q_b_proj.weight"), (Q_PROJ, "self_attn.q_proj.weight"),
             (KV_DOWN, "self_attn.kv_a_proj_with_mqa.weight"), (KV_NORM, "self_attn.kv_a_layernorm.weight"),
             (KV_UP, "self_attn.kv_b_proj.weight"), (O_PROJ, "self_attn.o_proj.weight"),
             (IN_NORM, "input_layernorm.weight"), (POST_NORM, "post_attention_layernorm.weight"))
_MTP_MAP = ((ENORM, "enorm.weight"), (HNORM, "hnorm.weight"), (EH_PROJ, "eh_proj.weight"),
            (MTP_NORM, "shared_head.norm.weight"))
_EXPERT = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")

ARCHITECTURE = "DeepseekV3ForCausalLM"


# ----------------------------------------------------------------------------------------------- config
def _yarn_fields(rope: Mapping[str, Any]) -> Dict[str, Any]:
    """Megatron's RoPE fields for HF's ``rope_parameters`` (default RoPE or YaRN; other scalings refused)."""
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    fields: Dict[str, Any] = dict(rotary_base=float(rope.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return dict(fields, rope_type="rope")
    if rope_type != "yarn":
        raise ValueError(f"rope_parameters.rope_type {rope_type!r}: DeepSeek-V3 converts with default RoPE or yarn")
    if rope.get("attention_factor") is not None:
        raise ValueError("rope_parameters.attention_factor: Megatron's YaRN derives it from mscale/mscale_all_dim; "
                         "drop it from config.json")
    return dict(fields, rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
                yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))


def _refusals(hf: Any) -> Optional[str]:
    """The first field of a DeepseekV3Config that has no Megatron form (None: it converts)."""
    topk, groups, group_topk = hf.num_experts_per_tok, hf.n_group or 1, hf.topk_group or 1
    checks = (
        (getattr(hf, "attention_bias", False), "attention_bias true: MLA here has no linear biases"),
        (getattr(hf, "hidden_act", "silu") != "silu", f"hidden_act {getattr(hf, 'hidden_act', '')!r}: only silu "
                                                      "(SwiGLU) maps to --swiglu"),
        (not getattr(hf, "rope_interleave", True), "rope_interleave false: Megatron's MLA rotates DeepSeek's "
                                                   "interleaved rope dims"),
        ((hf.num_key_value_heads or hf.num_attention_heads) != hf.num_attention_heads,
         "num_key_value_heads != num_attention_heads: MLA expands keys and values per head"),
        (bool(hf.norm_topk_prob) != (topk > 1), "norm_topk_prob must be true exactly when num_experts_per_tok > 1 "
                                                "(Megatron's sigmoid router renormalises the k weights)"),
        (groups > 1 and topk != 2 * group_topk, f"n_group {groups} with num_experts_per_tok {topk} / topk_group "
                                                f"{group_topk} != 2: HF scores a group by its best 2 experts, "
                                                "Megatron by its best k / topk_group"),
        (bool(getattr(hf, "pretraining_tp", 1) not in (1, None)), "pretraining_tp != 1 is not supported"),
    )
    return next((why for bad, why in checks if bad), None)


def deepseek_v3_fields_from_hf(hf: Any, mtp_layers: int = 0) -> Dict[str, Any]:
    """TransformerConfig fields of a HF DeepseekV3Config (dropouts 0); `mtp_layers` MTP modules stored in the folder.
    ValueError (one line naming the field) for what has no Megatron form."""
    why = _refusals(hf)
    if why:
        raise ValueError(why)
    layers, dense = hf.num_hidden_layers, min(hf.first_k_dense_replace or 0, hf.num_hidden_layers)
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    fields = dict(
        num_layers=layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
        ffn_hidden_size=hf.intermediate_size, max_position_embeddings=hf.max_position_embeddings,
        padded_vocab_size=hf.vocab_size, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=hf.rms_norm_eps,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
        add_qkv_bias=False, bias_gelu_fusion=False,
        share_embeddings_and_output_weights=bool(getattr(hf, "tie_word_embeddings", False)),
        multi_latent_attention=True, qk_layernorm=True, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
        qk_head_dim=hf.qk_nope_head_dim, qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
        **_yarn_fields(rope))
    if dense < layers:
        groups = hf.n_group if (hf.n_group or 1) > 1 else None
        fields.update(
            num_moe_experts=hf.n_routed_experts, moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size, moe_layer_freq=[0] * dense + [1] * (layers - dense),
            moe_shared_expert_intermediate_size=(hf.moe_intermediate_size * hf.n_shared_experts
                                                 if hf.n_shared_experts else None),
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
            moe_router_num_groups=groups, moe_router_group_topk=hf.topk_group if groups else None,
            moe_router_topk_scaling_factor=float(hf.routed_scaling_factor))
    if mtp_layers:
        fields["mtp_num_layers"] = mtp_layers
    return fields


def _first_dense(a: Any) -> int:
    """first_k_dense_replace of a model whose --moe-layer-freq pattern is k dense layers then MoE ones."""
    pattern = list(a.moe_layer_pattern) if a.num_moe_experts else [0] * a.num_layers
    k = pattern.index(1) if 1 in pattern else len(pattern)
    if any(v != 1 for v in pattern[k:]):
        raise ValueError(f"--moe-layer-freq {a.moe_layer_freq}: DeepSeek-V3 has its dense layers first, then only "
                         "MoE layers (first_k_dense_replace)")
    return k


def _router_kwargs(a: Any, dense: int) -> Dict[str, Any]:
    """DeepseekV3Config's router fields of a model (the refusals of what HF's router cannot express)."""
    if not a.num_moe_experts or dense == a.num_layers:
        return dict(n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1, norm_topk_prob=False,
                    moe_intermediate_size=a.ffn_hidden_size, n_shared_experts=0, routed_scaling_factor=1.0)
    topk = a.moe_router_topk
    groups, group_topk = a.moe_router_num_groups or 1, a.moe_router_group_topk or 1
    shared = a.moe_shared_expert_intermediate_size or 0
    checks = ((a.moe_router_score_function != "sigmoid", "--moe-router-score-function sigmoid"),
              (groups > 1 and topk != 2 * group_topk, "--moe-router-topk = 2 x --moe-router-group-topk"),
              (shared % a.moe_ffn_hidden_size, "a shared expert of a multiple of --moe-ffn-hidden-size"),
              (getattr(a, "moe_shared_expert_gate", False), "no --moe-shared-expert-gate"),
              (a.moe_expert_capacity_factor is not None, "no --moe-expert-capacity-factor"))
    missing = [need for bad, need in checks if bad]
    if missing:
        raise ValueError("DeepseekV3ForCausalLM routes as DeepSeek-V3 does; the model needs " + ", ".join(missing))
    return dict(n_routed_experts=a.num_moe_experts, num_experts_per_tok=topk, n_group=groups, topk_group=group_topk,
                norm_topk_prob=topk > 1, moe_intermediate_size=a.moe_ffn_hidden_size,
                n_shared_experts=shared // a.moe_ffn_hidden_size,
                routed_scaling_factor=float(a.moe_router_topk_scaling_factor or 1.0))


def hf_rope_parameters(a: Any) -> Dict[str, Any]:
    """HF ``rope_parameters`` of a model's RoPE fields (default or yarn)."""
    rope: Dict[str, Any] = {"rope_theta": float(a.rotary_base)}
    if getattr(a, "rope_type", "rope") != "yarn":
        return dict(rope, rope_type="default")
    rope.update(rope_type="yarn", factor=float(a.rotary_scaling_factor),
                original_max_position_embeddings=int(a.original_max_position_embeddings),
                beta_fast=float(a.beta_fast), beta_slow=float(a.beta_slow), mscale=float(a.mscale),
                mscale_all_dim=float(a.mscale_all_dim))
    if not a.yarn_correction_range_round_to_int:
        rope["truncate"] = False  # HF's default is true
    return rope


def hf_deepseek_v3_config_kwargs(a: Any, vocab_size: Optional[int] = None) -> Dict[str, Any]:
    """Keyword arguments of transformers.DeepseekV3Config for a model (`a`: a TransformerConfig or anything with
    its fields); ValueError naming what HF cannot express."""
    if not (getattr(a, "multi_latent_attention", False) and getattr(a, "qk_layernorm", False)):
        raise ValueError("DeepseekV3ForCausalLM has multi-latent attention with normed latents: the model needs "
                         "--multi-latent-attention --qk-layernorm")
    if not (a.swiglu and a.normalization == "RMSNorm" and a.position_embedding_type == "rope") or a.add_bias_linear:
        raise ValueError("DeepseekV3ForCausalLM needs --swiglu --normalization RMSNorm --position-embedding-type rope "
                         "--disable-bias-linear")
    dense = _first_dense(a)
    return dict(
        vocab_size=vocab_size or a.padded_vocab_size, hidden_size=a.hidden_size, intermediate_size=a.ffn_hidden_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_attention_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_head_dim, qk_rope_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim,
        first_k_dense_replace=dense, max_position_embeddings=a.max_position_embeddings,
        rms_norm_eps=a.layernorm_epsilon, hidden_act="silu", tie_word_embeddings=a.share_embeddings_and_output_weights,
        attention_bias=False, attention_dropout=a.attention_dropout, rope_interleave=True,
        rope_parameters=hf_rope_parameters(a), num_nextn_predict_layers=getattr(a, "mtp_num_layers", None) or 0,
        **_router_kwargs(a, dense))


# ----------------------------------------------------------------------------------------------- weights
def layer_from_hf(t: Any, src: str, moe: bool) -> Dict[str, torch.Tensor]:
    """One decoder layer's Megatron tensors from the HF names under `src` ("model.layers.{i}."); `t` gives
    ``t.get(name)``, ``name in t`` and ``t.keys()`` (the folder's lazy tensors, or a state dict)."""
    get = t.get
    out = {m: get(src + h) for m, h in _ATTN_MAP if src + h in t}
    mlp = src + "mlp."
    if not moe:
        out[FC1] = torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")], dim=0)
        out[FC2] = get(mlp + "down_proj.weight")
        return out
    experts = sorted({int(k[len(mlp + "experts."):].split(".")[0]) for k in t.keys() if k.startswith(mlp + "experts.")})
    gate_up = [torch.cat([get(f"{mlp}experts.{j}.{_EXPERT[0]}"), get(f"{mlp}experts.{j}.{_EXPERT[1]}")]).t()
               for j in experts]
    out.update({ROUTER: get(mlp + "gate.weight"), EXPERT_BIAS: get(mlp + "gate.e_score_correction_bias"),
                W1: torch.stack(gate_up).contiguous(),
                W2: torch.stack([get(f"{mlp}experts.{j}.{_EXPERT[2]}").t() for j in experts]).contiguous()})
    shared = mlp + "shared_experts."
    if shared + "gate_proj.weight" in t:
        out[SHARED_FC1] = torch.cat([get(shared + "gate_proj.weight"), get(shared + "up_proj.weight")], dim=0)
        out[SHARED_FC2] = get(shared + "down_proj.weight")
    return out


def layer_to_hf(layer: Mapping[str, torch.Tensor], dst: str) -> Dict[str, torch.Tensor]:
    """Inverse of `layer_from_hf`: HF names -> tensors (contiguous)."""
    out = {dst + h: layer[m] for m, h in _ATTN_MAP if m in layer}
    mlp = dst + "mlp."
    if FC1 in layer:
        gate, up = layer[FC1].chunk(2, dim=0)
        out.update({mlp + "gate_proj.weight": gate.contiguous(), mlp + "up_proj.weight": up.contiguous(),
                    mlp + "down_proj.weight": layer[FC2]})
        return out
    out[mlp + "gate.weight"] = layer[ROUTER]
    out[mlp + "gate.e_score_correction_bias"] = layer[EXPERT_BIAS]
    w1, w2 = layer[W1], layer[W2]
    for j in range(w1.size(0)):
        gate, up = w1[j].t().chunk(2, dim=0)
        e = f"{mlp}experts.{j}."
        out.update({e + _EXPERT[0]: gate.contiguous(), e + _EXPERT[1]: up.contiguous(),
                    e + _EXPERT[2]: w2[j].t().contiguous()})
    if SHARED_FC1 in layer:
        gate, up = layer[SHARED_FC1].chunk(2, dim=0)
        s = mlp + "shared_experts."
        out.update({s + "gate_proj.weight": gate.contiguous(), s + "up_proj.weight": up.contiguous(),
                    s + "down_proj.weight": layer[SHARED_FC2]})
    return {k: v.contiguous() for k, v in out.items()}


def mtp_from_hf(t: Any, src: str, moe: bool) -> Dict[str, torch.Tensor]:
    """One MTP module's Megatron tensors (keys relative to ``mtp.layers.{k}.``) from HF layer `src`."""
    out = {m: t.get(src + h) for m, h in _MTP_MAP}
    out.update({TRANSFORMER_LAYER + k: v for k, v in layer_from_hf(t, src, moe).items()})
    return out


def mtp_to_hf(mtp: Mapping[str, torch.Tensor], dst: str, embedding: torch.Tensor,
              output: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Inverse of `mtp_from_hf`, with HF's copies of the embedding and the output layer."""
    out = {dst + h: mtp[m] for m, h in _MTP_MAP}
    out.update(layer_to_hf({k[len(TRANSFORMER_LAYER):]: v for k, v in mtp.items() if k.startswith(TRANSFORMER_LAYER)},
                           dst))
    out[dst + "embed_tokens.weight"] = embedding.clone()  # copies: safetensors stores no shared storage
    out[dst + "shared_head.head.weight"] = output.clone()
    return out


def stored_mtp_layers(keys: Any, num_layers: int) -> int:
    """How many MTP modules a HF folder stores (its layers numbered from num_hidden_layers on, with an eh_proj)."""
    k = 0
    while f"model.layers.{num_layers + k}.eh_proj.weight" in keys:
        k += 1
    return k


# ----------------------------------------------------------------------------------------------- adapter
def _read(load_dir: str, cfg: Dict[str, Any], open_tensors: Callable[[], Any], *, model_type: str,
          true_vocab_size: Optional[int], tokenizer: Dict[str, Any]) -> Tuple[ModelMeta, Iterator[Message]]:
    """Loader half: the folder's architecture (with as many MTP layers as it stores) and its message stream."""
    tensors = open_tensors()
    hf_config = hf_config_object(load_dir)
    try:
        config = TransformerConfig(**deepseek_v3_fields_from_hf(
            hf_config, stored_mtp_layers(tensors, hf_config.num_hidden_layers)))
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"{load_dir}: {exc}") from None
    fields = architecture_of(config)
    meta = ModelMeta(model_type=model_type, architecture=fields, true_vocab_size=true_vocab_size or config.padded_vocab_size,
                     iteration=None, tokenizer=tokenizer, source=load_dir,
                     extra={"hf_architecture": ARCHITECTURE, "hf_config": cfg})
    return meta, _stream(tensors, meta.config())


def _stream(t: Any, config: TransformerConfig) -> Iterator[Message]:
    """The message stream of a DeepseekV3 folder."""
    yield Message(EMBEDDINGS, {"word_embeddings.weight": t.get("model.embed_tokens.weight")})
    pattern = config.moe_layer_pattern
    for i in range(config.num_layers):
        yield Message(layer_message(i), layer_from_hf(t, f"model.layers.{i}.", bool(pattern[i])))
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get("model.norm.weight")})
    if not config.share_embeddings_and_output_weights:
        yield Message(OUTPUT_LAYER, {"output_layer.weight": t.get("lm_head.weight")})
    if config.mtp_num_layers:
        yield Message(MTP, mtp_message_from_hf(t, config))


def mtp_message_from_hf(t: Any, config: TransformerConfig) -> Dict[str, torch.Tensor]:
    """The "mtp" message of a folder's MTP layers (HF layers num_hidden_layers + k); their copies of the embedding and
    the output layer must be the model's own (Megatron shares them), else ConversionError naming the tensor."""
    n, moe = config.num_layers, bool(config.moe_layer_pattern[-1])
    main = {"embed_tokens.weight": "model.embed_tokens.weight",
            "shared_head.head.weight": "model.embed_tokens.weight" if config.share_embeddings_and_output_weights
            else "lm_head.weight"}
    out: Dict[str, torch.Tensor] = {}
    for k in range(config.mtp_num_layers):
        src = f"model.layers.{n + k}."
        for own, shared in main.items():
            if src + own in t and not torch.equal(t.get(src + own), t.get(shared)):
                raise ConversionError(f"{src + own} differs from {shared}: Megatron's MTP shares the model's "
                                      "embedding and output layer")
        out.update({f"layers.{k}.{name}": v for name, v in mtp_from_hf(t, src, moe).items()})
    return out


def _head_to_hf(add: AddTensor, part: Checked, meta: ModelMeta, main: Dict[str, torch.Tensor]) -> None:
    """The saver's MTP half: each MTP layer as HF layer num_hidden_layers + k, with copies of the main tensors."""
    if part.name != MTP:
        raise ConversionError(f'unexpected message "{part.name}" after the model (is --model-type right?)')
    n = meta.architecture["num_layers"]
    depths = sorted({int(key.split(".")[1]) for key in part})
    for k in depths:
        prefix = f"layers.{k}."
        mtp = {key[len(prefix):]: part[key] for key in list(part) if key.startswith(prefix)}
        for name, tensor in mtp_to_hf(mtp, f"model.layers.{n + k}.", main["embedding"], main["output"]).items():
            add(name, tensor)


def _config_to_hf(config: TransformerConfig, rows: int, arch_name: Optional[str]) -> Any:
    if arch_name not in (None, ARCHITECTURE):
        raise ValueError(f"--hf-architecture {arch_name}: a multi-latent-attention model is a {ARCHITECTURE}")
    hf = hf_config_class("DeepseekV3Config")(**hf_deepseek_v3_config_kwargs(config, vocab_size=rows))
    hf.architectures = [ARCHITECTURE]
    return hf


def _embeddings_to_hf(add: AddTensor, emb: Checked, word: torch.Tensor) -> None:
    add("model.embed_tokens.weight", word)


def _layer_to_hf(add: AddTensor, i: int, layer: Checked, meta: ModelMeta, hf_config: Any) -> None:
    for name, tensor in layer_to_hf(layer, f"model.layers.{i}.").items():  # Checked: what it leaves is refused
        add(name, tensor)


def _final_norm_to_hf(add: AddTensor, norm: Checked) -> None:
    add("model.norm.weight", norm["final_layernorm.weight"])


_DEEPSEEK_V3 = DecoderMapping(config_from_hf=lambda load_dir, cfg: {}, weights_from_hf=lambda t, meta: iter(()),
                              config_to_hf=_config_to_hf, embeddings_to_hf=_embeddings_to_hf,
                              layer_to_hf=_layer_to_hf, final_norm_to_hf=_final_norm_to_hf, head_to_hf=_head_to_hf)
DEEPSEEK_V3 = HFAdapter(name="deepseek_v3", model_type="GPT", architectures=(ARCHITECTURE,), read=_read,
                        write=partial(write_decoder, _DEEPSEEK_V3),
                        accepts=lambda a: bool(a.get("multi_latent_attention")),
                        description="DeepSeek-V3 (--multi-latent-attention)")
