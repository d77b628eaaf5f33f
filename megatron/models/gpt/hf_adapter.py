"""Hugging Face adapters of the GPT family's members, as registry entries (megatron/models/registry.py):

- GPT-2 (``GPT2LMHeadModel``): HF's Conv1D weights are the transposes, c_attn's columns are [q, k, v] x heads; the MLP
  activation is the one Megatron computes from the flags (fused bias-GeLU / --openai-gelu = tanh = "gelu_new",
  --no-bias-gelu-fusion = erf = "gelu").
- The Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``; Megatron's grouped QKV, SwiGLU
  [gate; up], RMSNorm, RoPE in HF's half-split layout with no permutation, ``rope_theta`` -> --rotary-base) with its
  MoE members ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` (hf_moe.py).
- BLOOM (``BloomForCausalLM``: --position-embedding-type alibi --embed-layernorm, Megatron-DeepSpeed's names;
  hf_bloom.py).

The per-tensor mappings are those of hf.py / hf_moe.py / hf_bloom.py, applied one layer at a time while the shared
walk of megatron/checkpoint/conversion/hf_decoder.py reads or writes the folder.
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
from megatron.models.gpt import hf as hfc
from megatron.models.gpt import hf_bloom
from megatron.models.gpt import hf_moe as hfm
from megatron.models.hf_adapter import HFAdapter

_TANH_GELUS = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")


def _hf_config_object(load_dir: str) -> Any:
    import transformers

    return transformers.AutoConfig.from_pretrained(load_dir, local_files_only=True)


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
               hfc.qkv_hf_to_megatron(t.get(src + "attn.c_attn.weight").t(), nq, hd).contiguous(),
               "self_attention.query_key_value.bias": hfc.qkv_hf_to_megatron(t.get(src + "attn.c_attn.bias"), nq, hd)}
        for m_name, h_name, transpose in hfc._LAYER_MAP:
            v = t.get(src + h_name)
            out[m_name] = v.t().contiguous() if transpose else v
        yield Message(layer_message(i), out)
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get(pre + "ln_f.weight"),
                               "final_layernorm.bias": t.get(pre + "ln_f.bias")})
    if not meta.architecture["share_embeddings_and_output_weights"]:
        yield Message(OUTPUT_LAYER, {"output_layer.weight": t.get("lm_head.weight")})


def _gpt2_config_to_hf(config: TransformerConfig, rows: int, arch_name: Optional[str]) -> Any:
    import transformers

    kwargs = hfc.hf_gpt2_config_kwargs(config)
    if config.apply_layernorm_1p or config.apply_residual_connection_post_layernorm or \
            config.ffn_hidden_size is None or not config.add_bias_linear:
        raise ValueError("HF GPT-2 needs plain pre-LayerNorm layers with biases")
    # no BOS/EOS until the tokenizer says (GPT2Config's default 50256 lies outside a smaller vocabulary)
    hf = transformers.GPT2Config(**{"bos_token_id": None, "eos_token_id": None, **kwargs})
    hf.architectures = ["GPT2LMHeadModel"]
    return hf


def _gpt2_embeddings_to_hf(add: AddTensor, emb: Checked, word: torch.Tensor) -> None:
    add("transformer.wte.weight", word)
    add("transformer.wpe.weight", emb["position_embeddings.weight"])


def _gpt2_layer_to_hf(add: AddTensor, i: int, layer: Checked, meta: ModelMeta, hf_config: Any) -> None:
    nq, _, hd = heads(meta)
    dst = f"transformer.h.{i}."
    qkv = layer["self_attention.query_key_value.weight"]
    add(dst + "attn.c_attn.weight", hfc.qkv_megatron_to_hf(qkv, nq, hd).t().contiguous())
    add(dst + "attn.c_attn.bias", hfc.qkv_megatron_to_hf(layer["self_attention.query_key_value.bias"], nq, hd))
    for m_name, h_name, transpose in hfc._LAYER_MAP:
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


# ----------------------------------------------------------------------------------------------- Llama family
def _llama_config_from_hf(load_dir: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    hf_config = _hf_config_object(load_dir)
    try:
        config = (hfm.megatron_config_from_hf_moe(hf_config) if cfg["architectures"][0] in hfm.MOE_ARCHS
                  else hfc.megatron_config_from_hf_llama(hf_config))
    except ValueError as exc:
        raise ConversionError(f"{load_dir}: {exc}") from None
    return architecture_of(config)


def _llama_stream(t: Any, meta: ModelMeta) -> Iterator[Message]:
    nq, ng, hd = heads(meta)
    moe_pattern = meta.config().moe_layer_pattern  # MoE MLP (1) or dense MLP (0) per layer
    shared = bool(meta.architecture.get("moe_shared_expert_intermediate_size"))
    yield Message(EMBEDDINGS, {"word_embeddings.weight": t.get("model.embed_tokens.weight")})
    for i in range(meta.architecture["num_layers"]):
        src = f"model.layers.{i}."
        attn = src + "self_attn."
        out = {"self_attention.query_key_value.weight": hfc.qkv_pack_groups(
            t.get(attn + "q_proj.weight"), t.get(attn + "k_proj.weight"), t.get(attn + "v_proj.weight"), nq, ng, hd)}
        if attn + "q_proj.bias" in t:
            out["self_attention.query_key_value.bias"] = hfc.qkv_pack_groups(
                t.get(attn + "q_proj.bias"), t.get(attn + "k_proj.bias"), t.get(attn + "v_proj.bias"), nq, ng, hd)
        if moe_pattern[i]:
            out.update(hfm.hf_moe_mlp_to_megatron(t.get, src, meta.extra["hf_architecture"],
                                                  meta.architecture["num_moe_experts"], shared))
        else:
            out["mlp.dense_h_to_4h.weight"] = torch.cat([t.get(src + "mlp.gate_proj.weight"),
                                                         t.get(src + "mlp.up_proj.weight")], dim=0)
        for m_name, h_name in hfc._LLAMA_LAYER_MAP:
            if not (moe_pattern[i] and m_name.startswith("mlp.")):
                out[m_name] = t.get(src + h_name)
        yield Message(layer_message(i), out)
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get("model.norm.weight")})
    if not meta.architecture["share_embeddings_and_output_weights"]:
        head = "lm_head.weight" if "lm_head.weight" in t else "model.embed_tokens.weight"
        yield Message(OUTPUT_LAYER, {"output_layer.weight": t.get(head)})


def _llama_config_to_hf(config: TransformerConfig, rows: int, arch_name: Optional[str]) -> Any:
    import transformers

    kwargs = hfc.hf_llama_config_kwargs(config, vocab_size=rows)
    if config.num_moe_experts is not None:
        name = arch_name or hfm.hf_moe_arch(config)
        kwargs.update(hfm.hf_moe_config_kwargs(config, name))
        if name == "Qwen2MoeForCausalLM":
            kwargs.pop("head_dim", None)
        hf = getattr(transformers, name.replace("ForCausalLM", "Config"))(**kwargs)
        hf.architectures = [name]
        return hf
    name = arch_name or ("Qwen2ForCausalLM" if config.add_qkv_bias else "LlamaForCausalLM")
    if config.add_qkv_bias and name != "Qwen2ForCausalLM":
        raise ValueError("a QKV bias (--add-qkv-bias) exists only in Qwen2ForCausalLM")
    cls = getattr(transformers, name.replace("ForCausalLM", "Config"))
    if name == "MistralForCausalLM":
        kwargs["sliding_window"] = None
    hf = cls(**kwargs)
    hf.architectures = [name]
    return hf


def _llama_embeddings_to_hf(add: AddTensor, emb: Checked, word: torch.Tensor) -> None:
    add("model.embed_tokens.weight", word)


def _llama_layer_to_hf(add: AddTensor, i: int, layer: Checked, meta: ModelMeta, hf_config: Any) -> None:
    nq, ng, hd = heads(meta)
    dst = f"model.layers.{i}."
    q, k, v = hfc.qkv_unpack_groups(layer["self_attention.query_key_value.weight"], nq, ng, hd)
    add(dst + "self_attn.q_proj.weight", q)
    add(dst + "self_attn.k_proj.weight", k)
    add(dst + "self_attn.v_proj.weight", v)
    if "self_attention.query_key_value.bias" in layer:
        q, k, v = hfc.qkv_unpack_groups(layer["self_attention.query_key_value.bias"], nq, ng, hd)
        add(dst + "self_attn.q_proj.bias", q)
        add(dst + "self_attn.k_proj.bias", k)
        add(dst + "self_attn.v_proj.bias", v)
    if hfm.ROUTER in layer:
        for name, tensor in hfm.megatron_moe_mlp_to_hf(layer, dst, hf_config.architectures[0]).items():
            add(name, tensor)
    else:
        gate, up = layer["mlp.dense_h_to_4h.weight"].chunk(2, dim=0)
        add(dst + "mlp.gate_proj.weight", gate.contiguous())
        add(dst + "mlp.up_proj.weight", up.contiguous())
    for m_name, h_name in hfc._LLAMA_LAYER_MAP:
        if not (hfm.ROUTER in layer and m_name.startswith("mlp.")):
            add(dst + h_name, layer[m_name])


def _llama_final_norm_to_hf(add: AddTensor, norm: Checked) -> None:
    add("model.norm.weight", norm["final_layernorm.weight"])


def _llama_accepts(a: Dict[str, Any]) -> bool:
    return bool(a.get("swiglu")) and a.get("normalization") == "RMSNorm" and a.get("position_embedding_type") == "rope"


_LLAMA = DecoderMapping(config_from_hf=_llama_config_from_hf, weights_from_hf=_llama_stream,
                        config_to_hf=_llama_config_to_hf, embeddings_to_hf=_llama_embeddings_to_hf,
                        layer_to_hf=_llama_layer_to_hf, final_norm_to_hf=_llama_final_norm_to_hf)
LLAMA = HFAdapter(name="llama", model_type="GPT",
                  architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM") + hfm.MOE_ARCHS,
                  read=partial(read_decoder, _LLAMA), write=partial(write_decoder, _LLAMA), accepts=_llama_accepts,
                  description="Llama-family (--swiglu --normalization RMSNorm --position-embedding-type rope)")


# ----------------------------------------------------------------------------------------------- BLOOM
def _bloom_config_from_hf(load_dir: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    hf_config = _hf_config_object(load_dir)
    try:  # BLOOM has no position table; its length limit is a run-time setting (BigScience trained 2048)
        config = hf_bloom.megatron_config_from_hf_bloom(hf_config,
                                                        max_position_embeddings=int(cfg.get("seq_length", 2048)))
    except ValueError as exc:
        raise ConversionError(f"{load_dir}: {exc}") from None
    return architecture_of(config)


def _bloom_stream(t: Any, meta: ModelMeta) -> Iterator[Message]:
    pre = "transformer." if "transformer.word_embeddings.weight" in t else ""
    yield Message(EMBEDDINGS, {"word_embeddings.weight": t.get(pre + "word_embeddings.weight"),
                               "word_embeddings.norm.weight": t.get(pre + "word_embeddings_layernorm.weight"),
                               "word_embeddings.norm.bias": t.get(pre + "word_embeddings_layernorm.bias")})
    for i in range(meta.architecture["num_layers"]):
        yield Message(layer_message(i), {k: t.get(f"{pre}h.{i}.{k}") for k in hf_bloom.LAYER_KEYS})
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get(pre + "ln_f.weight"),
                               "final_layernorm.bias": t.get(pre + "ln_f.bias")})


def _bloom_config_to_hf(config: TransformerConfig, rows: int, arch_name: Optional[str]) -> Any:
    import transformers

    hf = transformers.BloomConfig(**hf_bloom.hf_bloom_config_kwargs(config, vocab_size=rows))
    hf.architectures = ["BloomForCausalLM"]
    return hf


def _bloom_embeddings_to_hf(add: AddTensor, emb: Checked, word: torch.Tensor) -> None:
    add("transformer.word_embeddings.weight", word)
    add("transformer.word_embeddings_layernorm.weight", emb["word_embeddings.norm.weight"])
    add("transformer.word_embeddings_layernorm.bias", emb["word_embeddings.norm.bias"])


def _bloom_layer_to_hf(add: AddTensor, i: int, layer: Checked, meta: ModelMeta, hf_config: Any) -> None:
    for key in hf_bloom.LAYER_KEYS:
        add(f"transformer.h.{i}.{key}", layer[key])


def _bloom_accepts(a: Dict[str, Any]) -> bool:
    return a.get("position_embedding_type") == "alibi" and bool(a.get("embed_layernorm"))


_BLOOM = DecoderMapping(config_from_hf=_bloom_config_from_hf, weights_from_hf=_bloom_stream,
                        config_to_hf=_bloom_config_to_hf, embeddings_to_hf=_bloom_embeddings_to_hf,
                        layer_to_hf=_bloom_layer_to_hf, final_norm_to_hf=_ln_f_to_hf)
BLOOM = HFAdapter(name="bloom", model_type="GPT", architectures=("BloomForCausalLM",),
                  read=partial(read_decoder, _BLOOM), write=partial(write_decoder, _BLOOM), accepts=_bloom_accepts,
                  description="BLOOM (--position-embedding-type alibi --embed-layernorm)")
