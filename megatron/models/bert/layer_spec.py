"""The BERT layer spec: GPT's parts with bidirectional (padding-masked) self-attention."""
from __future__ import annotations

from typing import Optional

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.enums import AttnMaskType
from megatron.layers.layer_specs import TransformerLayerSpec, transformer_layer_spec


def bert_layer_spec(config: Optional[TransformerConfig] = None) -> TransformerLayerSpec:
    """BERT encoder layer: the same parts as GPT's with bidirectional (padding-masked) self-attention."""
    del config
    return transformer_layer_spec(AttnMaskType.padding, cross_attention=False)
