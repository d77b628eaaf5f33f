"""Megatron BERT <-> Hugging Face `MegatronBertForPreTraining`: the weight and config mapping (TP=1, flat state dicts)
and the Hugging Face adapter (registry line BERT), which also reads and writes the finetuned
``MegatronBertForSequenceClassification`` / ``MegatronBertForMultipleChoice`` of tasks/' Classification /
MultipleChoice.

HF's MegatronBert has Megatron's architecture (pre-LN layers, final ``encoder.ln``, no embedding LayerNorm, pooler,
LM-head transform, tied decoder + bias, ``seq_relationship`` = binary head). Differences the mapping handles:
query_key_value rows are Megatron's [heads, (q, k, v), head_dim] and HF has separate query/key/value; HF has one
``hidden_act`` for the MLP and the LM head, so equal logits need Megatron's MLP to use the LM head's activation
(``--no-bias-gelu-fusion`` -> erf "gelu", ``--openai-gelu`` -> "gelu_new" for both); ``layer_norm_eps`` must be
Megatron's (1e-5); a model without the binary head has no token types (HF gets zero token-type rows) and no pooler
or ``seq_relationship`` (HF keeps its own, unused). BERT models are small, so the adapter maps the whole model at
once; a Megatron model whose MLP uses the fused (tanh) bias-GeLU has no HF equivalent and is refused with one line.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

import torch

from megatron.checkpoint.conversion.hf_decoder import copy_tokenizer
from megatron.checkpoint.conversion.hf_tokenizer_export import export_tokenizer
from megatron.checkpoint.conversion.interchange import (
    ConversionError,
    Message,
    ModelMeta,
    architecture_of,
    messages_from_state_dict,
    state_dict_from_messages,
)
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.layers.mlp import activation_for
from megatron.models.hf_adapter import HFAdapter
from megatron.models.hf_common import hf_config_class, qkv_hf_to_megatron, qkv_megatron_to_hf

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


# ----------------------------------------------------------------------------------------------- adapter
ARCHITECTURE = "MegatronBertForPreTraining"
# finetuned heads (tasks/): HF class -> Megatron head key; HF's ``classifier`` is the head, on HF's pooler + dropout
TASK_ARCHITECTURES = {"MegatronBertForSequenceClassification": "classification_head",
                      "MegatronBertForMultipleChoice": "multichoice_head"}
ARCHITECTURES = (ARCHITECTURE, *TASK_ARCHITECTURES)
_PRETRAINING_ONLY = ("lm_head.", "binary_head.")


def _task_to_hf(flat: Dict[str, Any], config: TransformerConfig, head: str) -> Dict[str, Any]:
    """Megatron Classification / MultipleChoice (flat, TP=1) -> HF MegatronBertFor{SequenceClassification,
    MultipleChoice}: the BERT body as the pretraining mapping (pooler and token types included), ``classifier``."""

    h = config.hidden_size
    stand_in = {"lm_head.dense.weight": torch.zeros(h, h), "lm_head.dense.bias": torch.zeros(h),
                "lm_head.layernorm.weight": torch.zeros(h), "lm_head.layernorm.bias": torch.zeros(h),
                "lm_head.bias": torch.zeros(1), "binary_head.weight": torch.zeros(2, h),
                "binary_head.bias": torch.zeros(2)}
    hf_sd = megatron_bert_to_hf_state_dict({**flat, **stand_in}, config)
    out = {k: v for k, v in hf_sd.items() if not k.startswith("cls.")}
    out["classifier.weight"], out["classifier.bias"] = flat[head + ".weight"], flat[head + ".bias"]
    return out


def _task_from_hf(hf_sd: Dict[str, Any], config: TransformerConfig, head: str) -> Dict[str, Any]:
    """Inverse of `_task_to_hf`."""

    stand_in = {k: torch.zeros(1) for k in (
        "cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias",
        "cls.predictions.bias", "cls.seq_relationship.weight", "cls.seq_relationship.bias")}
    flat = hf_to_megatron_bert_state_dict({**hf_sd, **stand_in}, config, binary_head=True)
    flat = {k: v for k, v in flat.items() if not k.startswith(_PRETRAINING_ONLY)}
    flat[head + ".weight"], flat[head + ".bias"] = hf_sd["classifier.weight"], hf_sd["classifier.bias"]
    return flat


def megatron_config_from_hf_bert(cfg: Dict[str, Any]) -> TransformerConfig:
    """The TransformerConfig of a MegatronBert config.json (dropouts 0; one line for an unmapped activation)."""
    act = cfg.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_new"):
        raise ConversionError(f"MegatronBert hidden_act {act!r} has no Megatron equivalent (gelu / gelu_new)")
    return TransformerConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"], ffn_hidden_size=cfg["intermediate_size"],
        max_position_embeddings=cfg["max_position_embeddings"], padded_vocab_size=cfg["vocab_size"],
        layernorm_epsilon=cfg.get("layer_norm_eps", 1e-12), openai_gelu=act == "gelu_new",
        bias_gelu_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)


def read_hf_bert(load_dir: str, cfg: Dict[str, Any], tensors: Any) -> Tuple[ModelMeta, Iterator[Message]]:
    """The loader's half: (meta, message stream) of a MegatronBert folder (pretraining or a finetuned head)."""
    config = megatron_config_from_hf_bert(cfg)
    hf_sd = {k: tensors.get(k) for k in tensors.keys()}
    arch = (cfg.get("architectures") or [ARCHITECTURE])[0]
    head = TASK_ARCHITECTURES.get(arch)
    bert = {"num_tokentypes": int(cfg.get("type_vocab_size", 2)), "add_binary_head": head is None}
    try:
        if head is None:
            flat = hf_to_megatron_bert_state_dict(hf_sd, config, binary_head=True)
        else:
            flat = _task_from_hf(hf_sd, config, head)
            bert.update(task_head=head, num_classes=int(flat[head + ".weight"].size(0)))
    except KeyError as exc:
        raise ConversionError(f"{load_dir}: tensor {exc} is missing from the weights") from None
    meta = ModelMeta(model_type="BERT", architecture=architecture_of(config), true_vocab_size=cfg["vocab_size"],
                     iteration=None, source=load_dir, extra={"bert": bert, "hf_architecture": arch})
    return meta, messages_from_state_dict(flat, config.num_layers)


def write_hf_bert(meta: ModelMeta, messages: Iterator[Message], save_dir: str, writer: Any,
                  checking: bool = True) -> Dict[str, Any]:
    """The saver's half: the message stream as a MegatronBert folder (weights through `writer`, config.json)."""
    flat = state_dict_from_messages(messages)
    heads = [h for h in TASK_ARCHITECTURES.values() if h + ".weight" in flat]
    rows = flat["language_model.embedding.word_embeddings.weight"].size(0)
    rows = min(rows, meta.true_vocab_size or rows)
    flat = {k: v[:rows] if k in ("language_model.embedding.word_embeddings.weight", "lm_head.bias") else v
            for k, v in flat.items()}
    config = meta.config(padded_vocab_size=rows)
    try:
        kwargs = hf_megatron_bert_config_kwargs(config, vocab_size=rows)
    except ValueError as exc:
        raise ConversionError(f"--saver hf: {exc}") from None
    if config.apply_layernorm_1p or config.normalization != "LayerNorm" or not config.add_bias_linear or \
            config.position_embedding_type != "learned_absolute":
        raise ConversionError("--saver hf: MegatronBert needs LayerNorm, biases and learned positions")
    tokentypes = meta.extra.get("bert", {}).get("num_tokentypes", 2) or 2
    kwargs["type_vocab_size"] = tokentypes
    architecture = ARCHITECTURE
    if heads:  # a finetuned classification / multiple-choice model
        architecture = {v: k for k, v in TASK_ARCHITECTURES.items()}[heads[0]]
        hf_sd = _task_to_hf(flat, config, heads[0])
        if heads[0] == "classification_head":
            kwargs["num_labels"] = int(flat[heads[0] + ".weight"].size(0))
    else:
        hf_sd = megatron_bert_to_hf_state_dict(flat, config)
        hf_sd.pop("cls.predictions.decoder.weight")  # tied to the word embeddings (HF re-ties it on load)
        hf_sd.pop("cls.predictions.decoder.bias", None)  # the same tensor as cls.predictions.bias
    for name, t in hf_sd.items():
        writer.add(name, t)
    files = writer.close()
    hf_config = hf_config_class("MegatronBertConfig")(**kwargs)
    hf_config.architectures = [architecture]
    hf_config.dtype = "float32"
    hf_config.save_pretrained(save_dir)
    return {"files": files, "architecture": architecture, "tokenizer_files": [], "vocab_size": rows,
            "dir": os.path.abspath(save_dir)}


def bert_config_or_none(cfg: Dict[str, Any]) -> Optional[str]:
    archs = cfg.get("architectures") or []
    return archs[0] if archs and archs[0] in ARCHITECTURES else None


def _read(load_dir: str, cfg: Dict[str, Any], open_tensors: Callable[[], Any], *, model_type: str, true_vocab_size: Optional[int],
          tokenizer: Dict[str, Any]) -> Tuple[ModelMeta, Iterator[Message]]:
    meta, stream = read_hf_bert(load_dir, cfg, open_tensors())
    meta.tokenizer = tokenizer
    return meta, stream


def _write(meta: ModelMeta, messages: Iterator[Message], save_dir: str, writer: Any, *,
           hf_architecture: Optional[str], checking: bool) -> Dict[str, Any]:
    summary = write_hf_bert(meta, messages, save_dir, writer, checking)
    summary["tokenizer_files"] = copy_tokenizer(meta, save_dir)
    summary["tokenizer_files"] += export_tokenizer(meta.tokenizer, save_dir)["files"]
    return summary


BERT = HFAdapter(name="bert", model_type="BERT", architectures=ARCHITECTURES, read=_read, write=_write,
                 description="MegatronBert (LayerNorm, biases, learned positions)")
