"""The GPT / Llama-family layer spec: which parts make up a decoder layer (GPTModel and GPTModelPipe build from it)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.enums import AttnMaskType
from megatron.layers.layer_specs import TransformerLayerSpec, moe_mlp_builder, transformer_layer_spec
from megatron.models.family_specs import family_layer_spec


def gpt_layer_spec(config: Optional[TransformerConfig] = None) -> TransformerLayerSpec:
    """GPT / Llama-family decoder-only layer: causal self-attention and an MLP (norms and variants from config);
    with --num-experts the MLP is the mixture of experts on the layers --moe-layer-freq selects. A config another
    family's layer fits (multi-latent attention) gets that family's spec (megatron/models/family_specs.py)."""
    family = family_layer_spec(config)
    if family is not None:
        return family
    spec = transformer_layer_spec(AttnMaskType.causal, cross_attention=False)
    if config is not None and config.num_moe_experts is not None:
        spec = dataclasses.replace(spec, mlp=moe_mlp_builder)
    return spec
