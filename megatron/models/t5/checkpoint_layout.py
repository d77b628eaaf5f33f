"""The T5 family's checkpoint layout: an encoder and a decoder stack (the encoder-decoder stream of
megatron/checkpoint/conversion/t5_format.py), its LM head's output layer under two Megatron Core names, its record
(each stack's layer count) and the T5Model that declares its tensor-parallel layouts."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping

import torch

from megatron.checkpoint.conversion.family_layout import CheckpointLayout
from megatron.core.transformer_config import TransformerConfig
from megatron.models.t5.model import T5Model

STACKS = ("encoder", "decoder")


def describe_t5(first: Mapping[str, Any], last: Mapping[str, Any]) -> Dict[str, Any]:
    """T5's record from a whole model's flat tensors (`first` and `last` the same): each stack's layer count."""
    counts = [len({k[len(f"language_model.{s}.layers."):].split(".")[0] for k in first
                   if k.startswith(f"language_model.{s}.layers.")}) for s in STACKS]
    return {"encoder_num_layers": counts[0], "decoder_num_layers": counts[1]}


def t5_layout_model(config: TransformerConfig, t5: Mapping[str, Any]) -> torch.nn.Module:
    """The TP=1 T5Model of `config` (with the record's layer counts when it has them), on the meta device."""
    if t5:
        config = dataclasses.replace(config, encoder_num_layers=t5["encoder_num_layers"],
                                     decoder_num_layers=t5["decoder_num_layers"])
    with torch.device("meta"):
        return T5Model(config)


T5_LAYOUT = CheckpointLayout(
    model_type="T5", model_class=T5Model, stacks=STACKS, markers=("language_model.decoder.",),
    core_head_objects=("output_layer", "lm_head.output_layer"), extra_key="t5", describe=describe_t5,
    layout_model=t5_layout_model)
