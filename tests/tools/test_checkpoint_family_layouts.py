"""The families' checkpoint layouts (megatron/models/<family>/checkpoint_layout.py), found through the registry: the
format code reads a family's names, stacks and records from them (no branch on the model type)."""
from __future__ import annotations

import torch

from megatron.checkpoint.conversion import megatron_format, torch_dist
from megatron.checkpoint.conversion.deepspeed_format import deepspeed_layout
from megatron.core.transformer_config import TransformerConfig
from megatron.models import registry
from megatron.models.bert.checkpoint_layout import BERT_LAYOUT
from megatron.models.bert.model import BertModel
from megatron.models.gpt.checkpoint_layout import GPT_LAYOUT
from megatron.models.gpt.model import GPTModel
from megatron.models.t5.checkpoint_layout import T5_LAYOUT
from megatron.models.t5.model import T5Model


def tiny(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=64,
                  max_position_embeddings=16, bias_gelu_fusion=False)
    return TransformerConfig(**{**kwargs, **overrides})


def test_the_registry_finds_each_family_layout() -> None:
    assert [registry.layout_for(t) for t in ("GPT", "BERT", "T5", "unknown")] == [
        GPT_LAYOUT, BERT_LAYOUT, T5_LAYOUT, GPT_LAYOUT]
    with torch.device("meta"):
        models = [GPTModel(tiny()), BertModel(tiny(), num_tokentypes=2, add_binary_head=True),
                  T5Model(tiny(decoder_num_layers=3))]
    assert [registry.layout_of_model(m).model_type for m in models] == ["GPT", "BERT", "T5"]


def test_the_legacy_heads_keep_megatrons_order() -> None:
    """The last stage's parts after the final norm: the output layer, the multi-token-prediction block (any GPT
    model's, megatron/layers/mtp.py), then BERT's declared heads, in the order the message stream has always carried
    them; the nested ones saved one level deep (the MTP block as the model's ``mtp`` dict)."""
    assert megatron_format.HEAD_PARTS == (
        ("language_model.output_layer.", "output layer"), ("mtp.", "mtp"), ("language_model.pooler.", "pooler"),
        ("lm_head.", "lm head"), ("binary_head.", "binary head"), ("classification_head.", "classification head"),
        ("multichoice_head.", "multichoice head"))
    nested = megatron_format.nest({"lm_head.bias": 1, "language_model.pooler.dense.weight": 2,
                                   "classification_head.weight": 3, "mtp.layers.0.enorm.weight": 4})
    assert nested == {"lm_head": {"bias": 1}, "language_model": {"pooler": {"dense.weight": 2}},
                      "classification_head": {"weight": 3}, "mtp": {"layers.0.enorm.weight": 4}}


def test_a_checkpoints_family_from_its_names() -> None:
    gpt = {"language_model.encoder.layers.0.mlp.dense_h_to_4h.weight": 0, "language_model.output_layer.weight": 0}
    bert = {**gpt, "lm_head.bias": 0, "binary_head.weight": 0}
    t5 = {**bert, "language_model.decoder.layers.0.mlp.dense_h_to_4h.weight": 0}  # T5's last stage has an lm_head too
    assert [torch_dist.model_type_of(f) for f in (gpt, bert, t5)] == ["GPT", "BERT", "T5"]
    assert [deepspeed_layout(t) for t in ("GPT", "BERT", "T5", "unknown")] == [True, False, False, False]


def test_the_families_records_from_their_tensors() -> None:
    bert_flat = {"language_model.embedding.tokentype_embeddings.weight": torch.zeros(2, 4),
                 "binary_head.weight": torch.zeros(2, 4), "classification_head.weight": torch.zeros(3, 4)}
    assert BERT_LAYOUT.describe(bert_flat, bert_flat) == {"num_tokentypes": 2, "add_binary_head": True,
                                                          "task_head": "classification_head", "num_classes": 3}
    t5_flat = {f"language_model.{s}.layers.{i}.x": 0 for s, n in (("encoder", 2), ("decoder", 3)) for i in range(n)}
    assert T5_LAYOUT.describe(t5_flat, t5_flat) == {"encoder_num_layers": 2, "decoder_num_layers": 3}


def test_the_tp_layouts_come_from_the_familys_model() -> None:
    """BERT's layouts are its BertModel's (pooler and heads included), built from the family's record."""
    meta = megatron_format.ModelMeta(model_type="BERT", architecture={
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "padded_vocab_size": 64,
        "max_position_embeddings": 16}, extra={"bert": {"num_tokentypes": 2, "add_binary_head": True}})
    layouts = megatron_format.layer_layouts(meta)
    assert "binary_head.weight" in layouts and "language_model.pooler.dense.weight" in layouts
    assert layouts["lm_head.bias"].dim == 0  # split over the vocabulary like the tied embedding
