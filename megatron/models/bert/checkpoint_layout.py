"""The BERT family's checkpoint layout: its pooler and heads after the final norm (pretraining LM head and binary
head; tasks/' classification and multiple-choice heads), its layers under Megatron Core's ``encoder.layers.``, its
record (token types, binary head, task head) and the BertModel that declares its tensor-parallel layouts."""
from __future__ import annotations

import argparse
from typing import Any, Dict, Mapping

import torch

from megatron.checkpoint.conversion.family_layout import CheckpointLayout, HeadModule
from megatron.core.transformer_config import TransformerConfig
from megatron.models.bert.model import BertModel

TOKENTYPE = "language_model.embedding.tokentype_embeddings.weight"
TASK_HEADS = ("classification_head", "multichoice_head")  # finetuned BERT (tasks/): replicated linear heads
HEADS = (HeadModule("language_model.pooler.", "pooler"), HeadModule("lm_head.", "lm head", nested=True),
         HeadModule("binary_head.", "binary head", nested=True),
         HeadModule("classification_head.", "classification head", nested=True),
         HeadModule("multichoice_head.", "multichoice head", nested=True))


def describe_bert(first: Mapping[str, Any], last: Mapping[str, Any]) -> Dict[str, Any]:
    """BERT's record from its first and last stages' flat tensors: token types, binary head, a finetuned task head."""
    out: Dict[str, Any] = {"num_tokentypes": int(first[TOKENTYPE].size(0)) if TOKENTYPE in first else 0,
                           "add_binary_head": any(k.startswith("binary_head.") for k in last)}
    heads = [h for h in TASK_HEADS if h + ".weight" in last]
    if heads:  # a finetuned classification / multiple-choice model (tasks/)
        out.update(task_head=heads[0], num_classes=int(last[heads[0] + ".weight"].size(0)))
    return out


def bert_layout_model(config: TransformerConfig, bert: Mapping[str, Any]) -> torch.nn.Module:
    """The TP=1 BertModel of `config` and BERT's record, on the meta device (its parameters declare the layouts)."""
    with torch.device("meta"):
        return BertModel(config, num_tokentypes=bert["num_tokentypes"], add_binary_head=bert["add_binary_head"])


def bert_saved_args(args: argparse.Namespace, bert: Mapping[str, Any]) -> None:
    """BERT's own entry in a written checkpoint's args."""
    args.bert_binary_head = bert["add_binary_head"]


BERT_LAYOUT = CheckpointLayout(
    model_type="BERT", model_class=BertModel, core_stack="encoder.layers.", heads=HEADS,
    markers=tuple(h.prefix for h in HEADS if h.nested), core_head_objects=("output_layer",), extra_key="bert",
    describe=describe_bert, layout_model=bert_layout_model, saved_args=bert_saved_args)
