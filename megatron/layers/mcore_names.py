"""Megatron Core parameter names <-> ours (Megatron-LM 23.06's), for GPT, Llama-family, BERT and T5 models.

Megatron Core calls the same tensors (same shapes, same tensor-parallel split, same fused-QKV row order and SwiGLU
halves per rank) by other names: ``embedding.word_embeddings.weight``, ``decoder.layers.N.self_attention.linear_qkv``,
``linear_proj``, ``mlp.linear_fc1``/``linear_fc2``, ``decoder.final_layernorm``, ``output_layer``. Its local layer spec
keeps ``input_layernorm``/``pre_mlp_layernorm``; the Transformer Engine spec folds them into the next linear
(``linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``, ``_bias`` likewise), which is also how
``torch_dist`` checkpoints name them. ``_extra_state`` entries (Transformer Engine's FP8 metadata) carry no weights and
are dropped. A per-rank file is renamed tensor by tensor; parts we do not model (QK norms, MoE expert biases) are one
line naming the key.

Mixture of experts (megatron/layers/moe.py): ``mlp.router.weight`` (and ``mlp.router.expert_bias``, the
aux-loss-free bias) and the shared expert (``mlp.shared_experts.
linear_fc1/linear_fc2/gate_weight``) are renamed; Megatron Core keeps one matrix per expert, output-major
(``mlp.experts.local_experts.E.linear_fc1.weight`` [F, h] with the local spec's SequentialMLP, or Transformer Engine's
grouped ``mlp.experts.linear_fc1.weightE``), which ours stacks input-major (``mlp.experts.weight1`` [E, h, F], ``weight2``
[E, F, h]): `core_to_ours` stacks and transposes them, `ours_to_core` splits them back (local spelling). In
``torch_dist`` they are ``mlp.experts.experts.linear_fc1.weight`` [layers, E, F, h] (torch_dist.py).
"""
from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Mapping

import torch

from megatron.errors import MegatronUserError

_LM = "language_model."
_LAYERS = _LM + "encoder.layers."

# (Core suffix inside a layer, our suffix); the fused-norm spellings first (prefix matches run in order)
LAYER_SUFFIXES = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "post_attention_layernorm.bias"),
    ("input_layernorm.", "input_layernorm."),
    ("pre_mlp_layernorm.", "post_attention_layernorm."),
    ("self_attention.linear_qkv.", "self_attention.query_key_value."),
    ("self_attention.linear_proj.", "self_attention.dense."),
    ("self_attention.k_layernorm.", "self_attention.k_layernorm."),  # --qk-layernorm (q_layernorm: MLA's entry)
    ("mlp.linear_fc1.", "mlp.dense_h_to_4h."),
    ("mlp.linear_fc2.", "mlp.dense_4h_to_h."),
    ("mlp.router.weight", "mlp.router.weight"),
    ("mlp.router.bias", "mlp.router.bias"),  # --add-bias-linear with experts (GPT-OSS)
    ("self_attention.core_attention.softmax_offset", "self_attention.core_attention.softmax_offset"),  # sinks
    ("mlp.router.expert_bias", "mlp.router.expert_bias"),  # --moe-router-enable-expert-bias (fp32 buffer)
    ("mlp.shared_experts.linear_fc1.", "mlp.shared_experts.dense_h_to_4h."),
    ("mlp.shared_experts.linear_fc2.", "mlp.shared_experts.dense_4h_to_h."),
    ("mlp.shared_experts.gate_weight", "mlp.shared_experts.gate_weight"),
)
# multi-latent attention (megatron/models/deepseek/mla.py) keeps Core's names; Transformer Engine's spec folds the
# latent norms into the up projections. Its output projection is ``linear_proj`` in ours too (`mla_output_names`).
MLA_SUFFIXES = (
    ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"),
    ("self_attention.linear_q_down_proj.", "self_attention.linear_q_down_proj."),
    ("self_attention.linear_q_up_proj.", "self_attention.linear_q_up_proj."),
    ("self_attention.linear_q_proj.", "self_attention.linear_q_proj."),
    ("self_attention.linear_kv_down_proj.", "self_attention.linear_kv_down_proj."),
    ("self_attention.linear_kv_up_proj.", "self_attention.linear_kv_up_proj."),
    ("self_attention.q_layernorm.", "self_attention.q_layernorm."),
    ("self_attention.kv_layernorm.", "self_attention.kv_layernorm."),
    ("self_attention.linear_proj.", "self_attention.linear_proj."),
)
LAYER_SUFFIXES += MLA_SUFFIXES
_MLA_MARK = ".self_attention.linear_kv_down_proj."


def mla_output_names(flat: Dict[str, Any]) -> Dict[str, Any]:
    """Our flat names with a multi-latent-attention layer's output projection called ``linear_proj`` (Core's name,
    which the rename turned into ParallelAttention's ``dense``)."""
    if not any(_MLA_MARK in k for k in flat):
        return flat
    return {k.replace(".self_attention.dense.", ".self_attention.linear_proj."): v for k, v in flat.items()}


# one expert's matrix: Core's per-expert names (local SequentialMLP / Transformer Engine grouped) -> our stacked name
_EXPERT_RE = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc([12])\.weight|linear_fc([12])\.weight(\d+))$")
OUR_EXPERTS = {"1": "mlp.experts.weight1", "2": "mlp.experts.weight2"}
# (Core prefix outside the layers, ours)
TOP_PREFIXES = (
    ("embedding.", _LM + "embedding."),
    ("decoder.final_layernorm.", _LM + "encoder.final_layernorm."),
    ("output_layer.", _LM + "output_layer."),
)

# BERT (Megatron Core's BertModel): its TransformerBlock is ``encoder`` (the layers as GPT's), the LM head's norm is
# ``layer_norm``, the head's bias ``output_layer.bias`` (its weight tied to the word embeddings; a last pipeline
# stage's copy ``output_layer.weight``), and ``pooler``/``binary_head`` sit at the top
BERT_PREFIXES = (
    ("embedding.", _LM + "embedding."),
    ("encoder.final_layernorm.", _LM + "encoder.final_layernorm."),
    ("lm_head.layer_norm.", "lm_head.layernorm."),
    ("lm_head.dense.", "lm_head.dense."),
    ("output_layer.bias", "lm_head.bias"),
    ("output_layer.weight", "word_embeddings.weight"),
    ("pooler.dense.", _LM + "pooler.dense."),
    ("binary_head.", "binary_head."),
)
_BERT_KEYS = ("encoder.", "lm_head.", "pooler.", "binary_head.")


def is_core_bert(keys: Iterable[str]) -> bool:
    """Whether Core-named keys are a BertModel's (its ``encoder.*``, heads and pooler)."""
    return any(k.startswith(_BERT_KEYS) for k in keys)


# T5 (Megatron Core's T5Model): ``encoder.layers.N`` and ``decoder.layers.N`` (each a TransformerBlock with its
# ``final_layernorm``); a decoder layer's ``pre_cross_attn_layernorm`` and ``cross_attention.linear_q / linear_kv /
# linear_proj`` are our ``post_attention_layernorm`` and ``inter_attention.query / key_value / dense`` (same shapes,
# the key/value rows interleaved per head as ours), its ``pre_mlp_layernorm`` our ``post_inter_attention_layernorm``.
# The head's bias is ``lm_head.output_layer.bias``, also listed as ``output_layer.bias`` (the same module under a
# second name, as ``position_embeddings.weight`` is the embedding's): read once, written under both names (as Core's
# own state dicts hold them).
T5_PREFIXES = (
    ("embedding.", _LM + "embedding."),
    ("encoder.final_layernorm.", _LM + "encoder.final_layernorm."),
    ("decoder.final_layernorm.", _LM + "decoder.final_layernorm."),
    ("lm_head.output_layer.bias", "lm_head.bias"),
    ("lm_head.output_layer.weight", "word_embeddings.weight"),  # a last pipeline stage's copy of the tied weights
)
T5_ALIASES = ("position_embeddings.", "output_layer.")  # second names of embedding.position_embeddings, lm_head's
_T5_DECODER = _LM + "decoder.layers."
_CROSS = (("pre_cross_attn_layernorm.", "post_attention_layernorm."), ("cross_attention.linear_q.",
          "inter_attention.query."), ("cross_attention.linear_kv.", "inter_attention.key_value."),
          ("cross_attention.linear_proj.", "inter_attention.dense."))


def is_core_t5(keys: Iterable[str]) -> bool:
    """Whether Core-named keys are a T5Model's (cross-attention in its decoder layers, or its LM head)."""
    return any(".cross_attention." in k or k.startswith("lm_head.output_layer.") for k in keys)


def is_our_t5(keys: Iterable[str]) -> bool:
    """Whether our flat names are a T5 model's (a decoder stack)."""
    return any(k.startswith(_LM + "decoder.") for k in keys)


def t5_decoder_suffix_to_ours(suffix: str, key: str) -> str:
    """A Core T5 decoder layer's layer-relative name -> ours."""
    for core, ours in _CROSS:
        if suffix.startswith(core):
            return ours + suffix[len(core):]
    ours = core_layer_suffix_to_ours(suffix, key)
    return "post_inter_attention_layernorm." + ours.partition(".")[2] if ours.startswith(
        "post_attention_layernorm.") else ours


def t5_decoder_suffix_to_core(suffix: str, fused_norms: bool) -> str:
    """Our T5 decoder layer's layer-relative name -> Core's (the MLP's norm folded into linear_fc1 with
    `fused_norms`; the cross-attention's norm is never folded)."""
    for core, ours in _CROSS:
        if suffix.startswith(ours):
            return core + suffix[len(ours):]
    if suffix.startswith("post_inter_attention_layernorm."):
        suffix = "post_attention_layernorm." + suffix.partition(".")[2]
    return our_layer_suffix_to_core(suffix, fused_norms)


_T5_SECOND_NAMES = {"output_layer.bias": "lm_head.output_layer.bias",
                    "position_embeddings.weight": "embedding.position_embeddings.weight"}


def _t5_core_to_ours(flat: Mapping[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    # a second name stands for its tensor where the first is absent (Core's optimizer state keeps one of the two)
    flat = {**{_T5_SECOND_NAMES[k]: v for k, v in flat.items() if k in _T5_SECOND_NAMES}, **flat}
    for key, value in flat.items():
        if _skipped(key) or key.startswith(T5_ALIASES):
            continue
        for stack, ours_stack, rename in (("encoder.layers.", _LAYERS, core_layer_suffix_to_ours),
                                          ("decoder.layers.", _T5_DECODER, t5_decoder_suffix_to_ours)):
            if key.startswith(stack):
                index, _, suffix = key[len(stack):].partition(".")
                out[f"{ours_stack}{index}.{rename(suffix, key)}"] = value
                break
        else:
            for core, ours in T5_PREFIXES:
                if key.startswith(core):
                    out[ours + key[len(core):]] = value
                    break
            else:
                raise UnsupportedCoreCheckpoint(f"Megatron Core tensor {key} is not part of a T5 model we know; this "
                                                "checkpoint cannot be loaded here")
    return out


def t5_ours_to_core(flat: Mapping[str, Any], fused_norms: bool = False) -> Dict[str, Any]:
    """Our T5 flat names -> Core's T5Model names (the head's bias under both of its names)."""
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(_LAYERS):
            index, _, suffix = key[len(_LAYERS):].partition(".")
            out[f"encoder.layers.{index}.{our_layer_suffix_to_core(suffix, fused_norms)}"] = value
        elif key.startswith(_T5_DECODER):
            index, _, suffix = key[len(_T5_DECODER):].partition(".")
            out[f"decoder.layers.{index}.{t5_decoder_suffix_to_core(suffix, fused_norms)}"] = value
        else:
            for core, ours in T5_PREFIXES:
                if key.startswith(ours):
                    out[core + key[len(ours):]] = value
                    break
            else:
                raise UnsupportedCoreCheckpoint(f"our T5 tensor {key} has no Megatron Core name")
    for name, alias in (("lm_head.output_layer.bias", "output_layer.bias"),
                        ("embedding.position_embeddings.weight", "position_embeddings.weight")):
        if name in out:
            out[alias] = out[name]
    return out


class UnsupportedCoreCheckpoint(MegatronUserError, ValueError):
    """A Megatron Core checkpoint holding a part this code does not model (one line naming the key)."""


def has_core_names(keys: Iterable[str]) -> bool:
    """Whether a flat state dict uses Megatron Core's names (``embedding.``, ``decoder.``, ``output_layer.``)."""
    return any(k.startswith(("embedding.", "decoder.", "output_layer.", "encoder.layers.", "encoder.final_layernorm."))
               for k in keys)


def _skipped(key: str) -> bool:
    return key.endswith("_extra_state") or key.endswith("inv_freq")


def core_layer_suffix_to_ours(suffix: str, key: str) -> str:
    """A layer-relative Core name -> ours (`key` names the tensor in the error)."""
    for core, ours in LAYER_SUFFIXES:
        if suffix == core or (core.endswith(".") and suffix.startswith(core)):
            return ours + suffix[len(core):] if core.endswith(".") else ours
    what = "a Mixture-of-Experts layer" if ".router." in key or ".experts." in key else "a part we do not model"
    raise UnsupportedCoreCheckpoint(f"Megatron Core tensor {key} belongs to {what}; this checkpoint cannot be "
                                    "loaded here (dense GPT / Llama-family models only)")


def core_to_ours(flat: Mapping[str, Any]) -> Dict[str, Any]:
    """A flat Core state dict (one rank's, or a full one) -> our flat names; `_extra_state` entries dropped."""
    if is_core_t5(flat):
        return _t5_core_to_ours(flat)
    mtp, flat = _split_mtp(flat)
    out: Dict[str, Any] = _mtp_names(mtp, core_to_ours, "decoder.layers.", _LAYERS) if mtp else {}
    experts: Dict[str, Dict[int, Any]] = {}
    bert = is_core_bert(flat)
    layers, tops = ("encoder.layers.", BERT_PREFIXES) if bert else ("decoder.layers.", TOP_PREFIXES)
    for key, value in flat.items():
        if _skipped(key):
            continue
        if key.startswith(layers):
            index, _, suffix = key[len(layers):].partition(".")
            m = _EXPERT_RE.match(suffix)
            if m:
                expert, which = int(m.group(1) or m.group(4)), m.group(2) or m.group(3)
                experts.setdefault(f"{_LAYERS}{index}.{OUR_EXPERTS[which]}", {})[expert] = value
                continue
            out[f"{_LAYERS}{index}.{core_layer_suffix_to_ours(suffix, key)}"] = value
            continue
        for core, ours in tops:
            if key.startswith(core):
                out[ours + key[len(core):]] = value
                break
        else:
            raise UnsupportedCoreCheckpoint(f"Megatron Core tensor {key} is not part of a {'BERT' if bert else 'GPT'} "
                                            "model we know; this checkpoint cannot be loaded here")
    for name, per_expert in experts.items():
        if sorted(per_expert) != list(range(len(per_expert))):
            raise UnsupportedCoreCheckpoint(f"Megatron Core experts of {name} are {sorted(per_expert)}, not 0..E-1: "
                                            "expert-parallel files are not merged here; convert with --loader mcore "
                                            "from a torch_dist checkpoint")
        out[name] = experts_to_ours([per_expert[e] for e in range(len(per_expert))])
    return mla_output_names(out)


def experts_to_ours(matrices: Any) -> Any:
    """Core's per-expert output-major matrices (a list, or a tensor [E, out, in]) -> ours [E, in, out]."""
    stacked = matrices if isinstance(matrices, torch.Tensor) else torch.stack(list(matrices))
    return stacked.transpose(1, 2).contiguous()


def experts_to_core(stacked: Any) -> Any:
    """Ours [E, in, out] -> Core's [E, out, in] (one output-major matrix per expert)."""
    return stacked.transpose(1, 2).contiguous()


def our_layer_suffix_to_core(suffix: str, fused_norms: bool) -> str:
    """Our layer-relative name -> Core's (norms folded into the next linear with `fused_norms`, as torch_dist)."""
    for core, ours in LAYER_SUFFIXES:
        fused = not core.endswith(".")
        if fused != fused_norms and ours.startswith(("input_layernorm", "post_attention_layernorm")):
            continue
        if fused and ours.startswith(("self_attention.q_layernorm", "self_attention.kv_layernorm")):
            continue  # MLA's latent norms are written as the local spec names them
        if suffix == ours or (ours.endswith(".") and suffix.startswith(ours)):
            return core + suffix[len(ours):] if ours.endswith(".") else core
    raise UnsupportedCoreCheckpoint(f"our layer tensor {suffix} has no Megatron Core name")


def is_our_bert(keys: Iterable[str]) -> bool:
    """Whether our flat names are a BERT model's (its LM head or binary head)."""
    return any(k.startswith(("lm_head.", "binary_head.")) for k in keys)


# Multi-token prediction (megatron/layers/mtp.py): Megatron Core's ``mtp.layers.N.{enorm,hnorm,eh_proj,
# final_layernorm}`` are ours too; each depth's ``transformer_layer`` is renamed as a decoder layer
MTP_LAYERS = "mtp.layers."
_MTP_LAYER = "transformer_layer."


def _split_mtp(flat: Mapping[str, Any]) -> tuple:
    mtp = {k: v for k, v in flat.items() if k.startswith(MTP_LAYERS)}
    return mtp, ({k: v for k, v in flat.items() if k not in mtp} if mtp else flat)


def _mtp_names(mtp: Mapping[str, Any], convert: Any, from_layers: str, to_layers: str) -> Dict[str, Any]:
    """The MTP block's tensors renamed: each depth's transformer layer by `convert` (as layer 0 of a decoder stack
    named `from_layers`, which `convert` names `to_layers`), the rest unchanged."""
    out: Dict[str, Any] = {}
    per_depth: Dict[str, Dict[str, Any]] = {}
    for key, value in mtp.items():
        depth, _, rest = key[len(MTP_LAYERS):].partition(".")
        if rest.startswith(_MTP_LAYER):
            per_depth.setdefault(depth, {})[f"{from_layers}0.{rest[len(_MTP_LAYER):]}"] = value
        else:
            out[key] = value
    for depth, layer in per_depth.items():
        for key, value in convert(layer).items():
            out[f"{MTP_LAYERS}{depth}.{_MTP_LAYER}{key[len(to_layers) + 2:]}"] = value
    return out


def ours_to_core(flat: Mapping[str, Any], fused_norms: bool = False) -> Dict[str, Any]:
    """Our flat names -> Core's (the local layer spec's spelling; `fused_norms`: Transformer Engine's); BERT's
    (lm_head / binary_head present) as Core's BertModel names them, T5's (a decoder stack) as its T5Model does."""
    if is_our_t5(flat):
        return t5_ours_to_core(flat, fused_norms)
    mtp, flat = _split_mtp(flat)
    out: Dict[str, Any] = _mtp_names(mtp, lambda layer: ours_to_core(layer, fused_norms), _LAYERS,
                                     "decoder.layers.") if mtp else {}
    bert = is_our_bert(flat)
    layers, tops = ("encoder.layers.", BERT_PREFIXES) if bert else ("decoder.layers.", TOP_PREFIXES)
    for key, value in flat.items():
        if key.startswith(_LAYERS):
            index, _, suffix = key[len(_LAYERS):].partition(".")
            which = {v: k for k, v in OUR_EXPERTS.items()}.get(suffix)
            if which is not None:
                for e, matrix in enumerate(experts_to_core(value)):
                    out[f"decoder.layers.{index}.mlp.experts.local_experts.{e}.linear_fc{which}.weight"] = matrix
                continue
            out[f"{layers}{index}.{our_layer_suffix_to_core(suffix, fused_norms)}"] = value
            continue
        for core, ours in tops:
            if key.startswith(ours):
                out[core + key[len(ours):]] = value
                break
        else:
            raise UnsupportedCoreCheckpoint(f"our tensor {key} has no Megatron Core name")
    return out
