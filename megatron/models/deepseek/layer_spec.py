"""The DeepSeek-V3 decoder layer: norm -> multi-latent attention -> norm -> MLP (the MoE on the layers
--moe-layer-freq marks); GPTModel and GPTModelPipe build it when config.multi_latent_attention is set
(megatron/models/family_specs.py)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.enums import AttnMaskType
from megatron.layers.layer_specs import TransformerLayerSpec, moe_mlp_builder, transformer_layer_spec
from megatron.models.deepseek.mla import MLASelfAttention


def mla_builder(config: TransformerConfig, layer_number: int, tp_group: Optional[Any]) -> torch.nn.Module:
    """Multi-latent self-attention (causal)."""
    return MLASelfAttention(config, layer_number, tp_group)


def deepseek_layer_spec(config: TransformerConfig) -> TransformerLayerSpec:
    """Decoder layer with multi-latent attention; the MLP is the mixture of experts with --num-experts."""
    spec = dataclasses.replace(transformer_layer_spec(AttnMaskType.causal), self_attention=mla_builder)
    if config.num_moe_experts is not None:
        spec = dataclasses.replace(spec, mlp=moe_mlp_builder)
    return spec
