"""Hugging Face ``MegatronBertForPreTraining`` (and the finetuned ``MegatronBertForSequenceClassification`` /
``MegatronBertForMultipleChoice`` of tasks/' Classification / MultipleChoice) as a conversion loader and saver for
``--model-type BERT``.

The tensor mapping is megatron.models.bert.hf's (separate query/key/value, ``encoder.ln`` final norm, LM-head
transform, tied decoder + bias, ``seq_relationship`` = binary head). BERT models are small, so the whole model is
mapped at once. HF has one ``hidden_act`` for the MLP and the LM head: erf "gelu" is ``--no-bias-gelu-fusion``,
"gelu_new" is ``--openai-gelu``; a Megatron model whose MLP uses the fused (tanh) bias-GeLU has no HF equivalent
and is refused with one line.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

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
from megatron.models.hf_adapter import HFAdapter

ARCHITECTURE = "MegatronBertForPreTraining"
# finetuned heads (tasks/): HF class -> Megatron head key; HF's ``classifier`` is the head, on HF's pooler + dropout
TASK_ARCHITECTURES = {"MegatronBertForSequenceClassification": "classification_head",
                      "MegatronBertForMultipleChoice": "multichoice_head"}
ARCHITECTURES = (ARCHITECTURE, *TASK_ARCHITECTURES)
_PRETRAINING_ONLY = ("lm_head.", "binary_head.")


def _task_to_hf(flat: Dict[str, Any], config: TransformerConfig, head: str) -> Dict[str, Any]:
    """Megatron Classification / MultipleChoice (flat, TP=1) -> HF MegatronBertFor{SequenceClassification,
    MultipleChoice}: the BERT body as the pretraining mapping (pooler and token types included), ``classifier``."""
    import torch

    from megatron.models.bert.hf import megatron_bert_to_hf_state_dict

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
    import torch

    from megatron.models.bert.hf import hf_to_megatron_bert_state_dict

    stand_in = {k: torch.zeros(1) for k in (
        "cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias",
        "cls.predictions.bias", "cls.seq_relationship.weight", "cls.seq_relationship.bias")}
    flat = hf_to_megatron_bert_state_dict({**hf_sd, **stand_in}, config, binary_head=True)
    flat = {k: v for k, v in flat.items() if not k.startswith(_PRETRAINING_ONLY)}
    flat[head + ".weight"], flat[head + ".bias"] = hf_sd["classifier.weight"], hf_sd["classifier.bias"]
    return flat


def megatron_config_from_hf_bert(cfg: Dict[str, Any]) -> TransformerConfig:
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
    from megatron.models.bert.hf import hf_to_megatron_bert_state_dict

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
    import transformers

    from megatron.models.bert.hf import hf_megatron_bert_config_kwargs, megatron_bert_to_hf_state_dict

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
    hf_config = transformers.MegatronBertConfig(**kwargs)
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
