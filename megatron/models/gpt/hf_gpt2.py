"""GPT-2 (`GPT2LMHeadModel`) <-> Megatron GPT: the weight and config mapping (TP=1 state dicts, reused by the
checkpoint tools) and the Hugging Face adapter (registry line GPT2).

Megatron (checkpoint_version >= 2) orders the fused query_key_value rows as [heads, (q, k, v), head_dim]; HF's c_attn
is a Conv1D (weight stored [in, out]) with output columns ordered [(q, k, v), heads, head_dim]. Every other HF Conv1D
weight is the transpose of the Megatron linear weight. The MLP activation maps as Megatron computes it: bias-gelu
fusion (Megatron's default) and --openai-gelu are the tanh approximation (HF "gelu_new"), --no-bias-gelu-fusion is erf
GeLU (HF "gelu"). The adapter applies the per-layer mapping one layer at a time while the shared walk of
megatron/checkpoint/conversion/hf_decoder.py reads or writes the folder.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Dict, Iterator, Mapping, Optional

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
    layer_message,
)
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.layers.mlp import activation_for
from megatron.models.hf_adapter import HFAdapter
from megatron.models.hf_common import ENC as _ENC
from megatron.models.hf_common import LM as _LM
from megatron.models.hf_common import encoder_layer_count, hf_config_class, qkv_hf_to_megatron, qkv_megatron_to_hf

_TANH_GELUS = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")

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
    for i in range(encoder_layer_count(flat)):
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


# ----------------------------------------------------------------------------------------------- GPT-2
def megatron_config_from_hf_gpt2(cfg: Any) -> Dict[str, Any]:
    """Architecture fields for a HF GPT2Config (an object or its dict)."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    act = get("activation_function", "gelu_new")
    if act not in _TANH_GELUS + ("gelu",):
        raise ConversionError(f"GPT-2 activation_function {act!r} has no Megatron equivalent (gelu_new / gelu)")
    if get("scale_attn_by_inverse_layer_idx", False) or not get("scale_attn_weights", True):
        raise ConversionError("GPT-2 configs with scale_attn_by_inverse_layer_idx or without scale_attn_weights "
                              "are not supported")
    hidden = get("n_embd")
    return dict(num_layers=get("n_layer"), hidden_size=hidden, num_attention_heads=get("n_head"),
                ffn_hidden_size=get("n_inner") or 4 * hidden, kv_channels=hidden // get("n_head"),
                max_position_embeddings=get("n_positions"), padded_vocab_size=get("vocab_size"),
                layernorm_epsilon=get("layer_norm_epsilon", 1e-5), bias_gelu_fusion=act != "gelu",
                share_embeddings_and_output_weights=bool(get("tie_word_embeddings", True)),
                normalization="LayerNorm", position_embedding_type="learned_absolute", add_bias_linear=True)


def _gpt2_stream(t: Any, meta: ModelMeta) -> Iterator[Message]:
    pre = "transformer." if "transformer.wte.weight" in t else ""
    nq, _, hd = heads(meta)
    yield Message(EMBEDDINGS, {"word_embeddings.weight": t.get(pre + "wte.weight"),
                               "position_embeddings.weight": t.get(pre + "wpe.weight")})
    for i in range(meta.architecture["num_layers"]):
        src = f"{pre}h.{i}."
        out = {"self_attention.query_key_value.weight":
               qkv_hf_to_megatron(t.get(src + "attn.c_attn.weight").t(), nq, hd).contiguous(),
               "self_attention.query_key_value.bias": qkv_hf_to_megatron(t.get(src + "attn.c_attn.bias"), nq, hd)}
        for m_name, h_name, transpose in _LAYER_MAP:
            v = t.get(src + h_name)
            out[m_name] = v.t().contiguous() if transpose else v
        yield Message(layer_message(i), out)
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get(pre + "ln_f.weight"),
                               "final_layernorm.bias": t.get(pre + "ln_f.bias")})
    if not meta.architecture["share_embeddings_and_output_weights"]:
        yield Message(OUTPUT_LAYER, {"output_layer.weight": t.get("lm_head.weight")})


def _gpt2_config_to_hf(config: TransformerConfig, rows: int, arch_name: Optional[str]) -> Any:
    kwargs = hf_gpt2_config_kwargs(config)
    if config.apply_layernorm_1p or config.apply_residual_connection_post_layernorm or \
            config.ffn_hidden_size is None or not config.add_bias_linear:
        raise ValueError("HF GPT-2 needs plain pre-LayerNorm layers with biases")
    # no BOS/EOS until the tokenizer says (GPT2Config's default 50256 lies outside a smaller vocabulary)
    hf = hf_config_class("GPT2Config")(**{"bos_token_id": None, "eos_token_id": None, **kwargs})
    hf.architectures = ["GPT2LMHeadModel"]
    return hf


def _gpt2_embeddings_to_hf(add: AddTensor, emb: Checked, word: torch.Tensor) -> None:
    add("transformer.wte.weight", word)
    add("transformer.wpe.weight", emb["position_embeddings.weight"])


def _gpt2_layer_to_hf(add: AddTensor, i: int, layer: Checked, meta: ModelMeta, hf_config: Any) -> None:
    nq, _, hd = heads(meta)
    dst = f"transformer.h.{i}."
    qkv = layer["self_attention.query_key_value.weight"]
    add(dst + "attn.c_attn.weight", qkv_megatron_to_hf(qkv, nq, hd).t().contiguous())
    add(dst + "attn.c_attn.bias", qkv_megatron_to_hf(layer["self_attention.query_key_value.bias"], nq, hd))
    for m_name, h_name, transpose in _LAYER_MAP:
        v = layer[m_name]
        add(dst + h_name, v.t().contiguous() if transpose else v)


def _ln_f_to_hf(add: AddTensor, norm: Checked) -> None:
    add("transformer.ln_f.weight", norm["final_layernorm.weight"])
    add("transformer.ln_f.bias", norm["final_layernorm.bias"])


def _gpt2_accepts(a: Dict[str, Any]) -> bool:
    return a.get("position_embedding_type", "learned_absolute") == "learned_absolute" and \
        a.get("normalization", "LayerNorm") == "LayerNorm" and not (a.get("swiglu") or a.get("squared_relu"))


_GPT2 = DecoderMapping(config_from_hf=lambda load_dir, cfg: megatron_config_from_hf_gpt2(cfg),
                       weights_from_hf=_gpt2_stream, config_to_hf=_gpt2_config_to_hf,
                       embeddings_to_hf=_gpt2_embeddings_to_hf, layer_to_hf=_gpt2_layer_to_hf,
                       final_norm_to_hf=_ln_f_to_hf)
GPT2 = HFAdapter(name="gpt2", model_type="GPT", architectures=("GPT2LMHeadModel",),
                 read=partial(read_decoder, _GPT2), write=partial(write_decoder, _GPT2), accepts=_gpt2_accepts,
                 description="GPT-2 (learned positions, LayerNorm, GeLU)")
