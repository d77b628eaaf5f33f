"""The T5 layer specs: the encoder's (the shared bidirectional layer, as BERT's) and the decoder's (with
cross-attention)."""
from __future__ import annotations

from typing import Optional

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.enums import AttnMaskType
from megatron.layers.layer_specs import TransformerLayerSpec, transformer_layer_spec


def t5_encoder_layer_spec(config: Optional[TransformerConfig] = None) -> TransformerLayerSpec:
    """T5 encoder layer: the same parts as BERT's layer (bidirectional, padding-masked self-attention)."""
    del config
    return transformer_layer_spec(AttnMaskType.padding, cross_attention=False)


def t5_decoder_layer_spec(config: Optional[TransformerConfig] = None) -> TransformerLayerSpec:
    """T5 decoder layer: causal self-attention, cross-attention (``inter_attention``) with its norm, then the MLP."""
    del config
    return transformer_layer_spec(AttnMaskType.causal, cross_attention=True)
