"""Which family's decoder layer a GPT-style config asks for: one line per family whose layer differs from GPT's
(its test of the config, its layer-spec function). GPT's spec asks here first (megatron/models/gpt/layer_spec.py), so
the GPT folder never imports another family; kept apart from registry.py, whose checkpoint layouts import models."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.layer_specs import TransformerLayerSpec
from megatron.models.deepseek.layer_spec import deepseek_layer_spec


def uses_mla(config: TransformerConfig) -> bool:
    return config.multi_latent_attention


FAMILY_SPECS: Tuple[Tuple[Callable[[TransformerConfig], bool], Callable[[TransformerConfig], TransformerLayerSpec]],
                    ...] = ((uses_mla, deepseek_layer_spec),)


def family_layer_spec(config: Optional[TransformerConfig]) -> Optional[TransformerLayerSpec]:
    """The layer spec of the first family whose test `config` passes (None: GPT's own)."""
    if config is None:
        return None
    return next((spec(config) for wants, spec in FAMILY_SPECS if wants(config)), None)
