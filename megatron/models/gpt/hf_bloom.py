"""BLOOM (our GPT with ALiBi and --embed-layernorm) <-> Hugging Face `BloomForCausalLM`: the weight and config mapping
(TP=1 state dicts) and the Hugging Face adapter (registry line BLOOM).

BLOOM was trained with Megatron-DeepSpeed, so the layouts agree almost name for name: query_key_value rows are
[heads, (q, k, v), head_dim] on both sides, every linear is stored [out, in], the MLP is a 4h tanh-GeLU with biases
(our bias-GeLU fusion computes the same tanh approximation), and the output layer is tied. Only the names differ:
HF's ``word_embeddings_layernorm`` is Megatron-DeepSpeed's ``word_embeddings.norm`` and ``ln_f`` is
``final_layernorm``.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Dict, Iterator, Mapping, Optional

import torch

from megatron.checkpoint.conversion.hf_decoder import AddTensor, Checked, DecoderMapping, read_decoder, write_decoder
from megatron.checkpoint.conversion.interchange import (
    EMBEDDINGS,
    FINAL_NORM,
    ConversionError,
    Message,
    ModelMeta,
    architecture_of,
    layer_message,
)
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.models.hf_adapter import HFAdapter
from megatron.models.hf_common import hf_config_class, hf_config_object, pad_rows

_LM = "language_model."
_EMB = _LM + "embedding.word_embeddings."
_ENC = _LM + "encoder."
_HF = "transformer."

# Per-layer suffixes: identical on both sides.
LAYER_KEYS = [
    "input_layernorm.weight", "input_layernorm.bias",
    "self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
    "self_attention.dense.weight", "self_attention.dense.bias",
    "post_attention_layernorm.weight", "post_attention_layernorm.bias",
    "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
    "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias",
]
# (ours, HF) outside the layers.
_OUTER_KEYS = [
    (_EMB + "weight", _HF + "word_embeddings.weight"),
    (_EMB + "norm.weight", _HF + "word_embeddings_layernorm.weight"),
    (_EMB + "norm.bias", _HF + "word_embeddings_layernorm.bias"),
    (_ENC + "final_layernorm.weight", _HF + "ln_f.weight"),
    (_ENC + "final_layernorm.bias", _HF + "ln_f.bias"),
]


def is_bloom_config(config: TransformerConfig) -> bool:
    """True for the BLOOM architecture (ALiBi, embedding LayerNorm)."""
    return config.position_embedding_type == "alibi" and config.embed_layernorm


def check_bloom(config: TransformerConfig) -> None:
    """One line when `config` is not exactly what BloomForCausalLM computes."""
    problems = []
    if not is_bloom_config(config):
        problems.append("--position-embedding-type alibi --embed-layernorm")
    if config.normalization != "LayerNorm" or config.apply_layernorm_1p:
        problems.append("--normalization LayerNorm (no --apply-layernorm-1p)")
    if not config.add_bias_linear or config.num_query_groups != config.num_attention_heads:
        problems.append("linear biases and one K/V head per query head")
    if config.swiglu or config.glu_activation or config.squared_relu or not (
            config.openai_gelu or config.bias_gelu_fusion):
        problems.append("the tanh GeLU MLP (default bias-GeLU fusion or --openai-gelu)")
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        problems.append("--kv-channels = hidden / heads")
    if not config.share_embeddings_and_output_weights:
        problems.append("tied embeddings (no --untie-embeddings-and-output-weights)")
    if problems:
        raise ValueError("Hugging Face BLOOM needs " + "; ".join(problems))


def megatron_to_hf_bloom_state_dict(state_dict: Mapping[str, Any], config: TransformerConfig,
                                    vocab_size: Optional[int] = None) -> dict:
    """Our BLOOM state dict (nested checkpoint layout or flat names, TP=1) -> `BloomForCausalLM` dict
    (`vocab_size` drops padding rows)."""
    check_bloom(config)
    flat = flatten_checkpoint_state_dict(state_dict)
    if _EMB + "norm.weight" not in flat:
        raise ValueError(f"not a full TP=1/PP=1 BLOOM state dict: missing {_EMB + 'norm.weight'!r}")
    out = {hf: flat[ours] for ours, hf in _OUTER_KEYS}
    rows = slice(0, vocab_size)
    out[_HF + "word_embeddings.weight"] = out[_HF + "word_embeddings.weight"][rows]
    layer_ids = {int(k[len(_ENC + "layers."):].split(".")[0]) for k in flat if k.startswith(_ENC + "layers.")}
    for i in range(len(layer_ids)):
        for key in LAYER_KEYS:
            out[f"{_HF}h.{i}.{key}"] = flat[f"{_ENC}layers.{i}.{key}"]
    out["lm_head.weight"] = out[_HF + "word_embeddings.weight"]
    return out


def hf_bloom_to_megatron_state_dict(hf_state_dict: Mapping[str, Any], config: TransformerConfig) -> dict:
    """`BloomForCausalLM` (or `BloomModel`) dict -> flat names of our GPT (TP=1); the vocabulary is padded to
    `config.padded_vocab_size` with zero rows."""
    check_bloom(config)
    sd = dict(hf_state_dict)
    if _HF + "word_embeddings.weight" not in sd and "word_embeddings.weight" in sd:
        sd = {_HF + k: v for k, v in sd.items()}
    if _HF + "word_embeddings_layernorm.weight" not in sd:
        raise ValueError("not a Hugging Face BLOOM state dict: missing 'transformer.word_embeddings_layernorm.weight'")
    out = {ours: sd[hf] for ours, hf in _OUTER_KEYS}
    words = out[_EMB + "weight"]
    out[_EMB + "weight"] = pad_rows(words, config.padded_vocab_size or words.size(0))
    layer_ids = {int(k.split(".")[2]) for k in sd if k.startswith(_HF + "h.")}
    for i in range(len(layer_ids)):
        for key in LAYER_KEYS:
            out[f"{_ENC}layers.{i}.{key}"] = sd[f"{_HF}h.{i}.{key}"]
    return out


def megatron_config_from_hf_bloom(hf_config: Any, **overrides: Any) -> TransformerConfig:
    """A TransformerConfig computing what a HF `BloomConfig` computes (dropouts 0 unless overridden)."""
    if getattr(hf_config, "pretraining_tp", 1) > 1 and getattr(hf_config, "slow_but_exact", False):
        raise ValueError("BloomConfig slow_but_exact=True (pretraining_tp > 1 sliced matmuls) is not modelled")
    heads, hidden = hf_config.n_head, hf_config.hidden_size
    kwargs = dict(
        num_layers=hf_config.n_layer, hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=4 * hidden, padded_vocab_size=hf_config.vocab_size,
        max_position_embeddings=overrides.pop("max_position_embeddings", 2048),
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=hf_config.layer_norm_epsilon,
        position_embedding_type="alibi", embed_layernorm=True, bias_gelu_fusion=True,
        apply_residual_connection_post_layernorm=bool(hf_config.apply_residual_connection_post_layernorm),
        share_embeddings_and_output_weights=True,
    )
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    check_bloom(config)
    return config


def hf_bloom_config_kwargs(config: TransformerConfig, vocab_size: Optional[int] = None) -> dict:
    """Keyword arguments for transformers.BloomConfig describing the same model."""
    check_bloom(config)
    if config.ffn_hidden_size != 4 * config.hidden_size:
        raise ValueError(f"Hugging Face BLOOM has a 4 * hidden MLP; --ffn-hidden-size is {config.ffn_hidden_size}")
    return dict(
        vocab_size=vocab_size or config.padded_vocab_size, hidden_size=config.hidden_size, n_layer=config.num_layers,
        n_head=config.num_attention_heads, layer_norm_epsilon=config.layernorm_epsilon,
        apply_residual_connection_post_layernorm=config.apply_residual_connection_post_layernorm,
        hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
        tie_word_embeddings=True, pretraining_tp=1, slow_but_exact=False,
    )


# ----------------------------------------------------------------------------------------------- adapter
def _bloom_config_from_hf(load_dir: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    hf_config = hf_config_object(load_dir)
    try:  # BLOOM has no position table; its length limit is a run-time setting (BigScience trained 2048)
        config = megatron_config_from_hf_bloom(hf_config, max_position_embeddings=int(cfg.get("seq_length", 2048)))
    except ValueError as exc:
        raise ConversionError(f"{load_dir}: {exc}") from None
    return architecture_of(config)


def _bloom_stream(t: Any, meta: ModelMeta) -> Iterator[Message]:
    pre = "transformer." if "transformer.word_embeddings.weight" in t else ""
    yield Message(EMBEDDINGS, {"word_embeddings.weight": t.get(pre + "word_embeddings.weight"),
                               "word_embeddings.norm.weight": t.get(pre + "word_embeddings_layernorm.weight"),
                               "word_embeddings.norm.bias": t.get(pre + "word_embeddings_layernorm.bias")})
    for i in range(meta.architecture["num_layers"]):
        yield Message(layer_message(i), {k: t.get(f"{pre}h.{i}.{k}") for k in LAYER_KEYS})
    yield Message(FINAL_NORM, {"final_layernorm.weight": t.get(pre + "ln_f.weight"),
                               "final_layernorm.bias": t.get(pre + "ln_f.bias")})


def _bloom_config_to_hf(config: TransformerConfig, rows: int, arch_name: Optional[str]) -> Any:
    hf = hf_config_class("BloomConfig")(**hf_bloom_config_kwargs(config, vocab_size=rows))
    hf.architectures = ["BloomForCausalLM"]
    return hf


def _bloom_embeddings_to_hf(add: AddTensor, emb: Checked, word: torch.Tensor) -> None:
    add("transformer.word_embeddings.weight", word)
    add("transformer.word_embeddings_layernorm.weight", emb["word_embeddings.norm.weight"])
    add("transformer.word_embeddings_layernorm.bias", emb["word_embeddings.norm.bias"])


def _bloom_layer_to_hf(add: AddTensor, i: int, layer: Checked, meta: ModelMeta, hf_config: Any) -> None:
    for key in LAYER_KEYS:
        add(f"transformer.h.{i}.{key}", layer[key])


def _ln_f_to_hf(add: AddTensor, norm: Checked) -> None:
    add("transformer.ln_f.weight", norm["final_layernorm.weight"])
    add("transformer.ln_f.bias", norm["final_layernorm.bias"])


def _bloom_accepts(a: Dict[str, Any]) -> bool:
    return a.get("position_embedding_type") == "alibi" and bool(a.get("embed_layernorm"))


_BLOOM = DecoderMapping(config_from_hf=_bloom_config_from_hf, weights_from_hf=_bloom_stream,
                        config_to_hf=_bloom_config_to_hf, embeddings_to_hf=_bloom_embeddings_to_hf,
                        layer_to_hf=_bloom_layer_to_hf, final_norm_to_hf=_ln_f_to_hf)
BLOOM = HFAdapter(name="bloom", model_type="GPT", architectures=("BloomForCausalLM",),
                  read=partial(read_decoder, _BLOOM), write=partial(write_decoder, _BLOOM), accepts=_bloom_accepts,
                  description="BLOOM (--position-embedding-type alibi --embed-layernorm)")
