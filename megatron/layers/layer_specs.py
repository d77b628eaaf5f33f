"""Spec-lite: which modules make up a transformer layer, filled by one plain function per model family.

A `TransformerLayerSpec` names a builder for each part of a layer (input norm, self-attention, optional
cross-attention with its norm, pre-MLP norm, MLP); every builder is called as ``builder(config, layer_number,
tp_group)``. `ParallelTransformerLayer` builds itself from a spec (keeping Megatron's attribute and checkpoint names:
``input_layernorm``, ``self_attention``, ``post_attention_layernorm``, ``inter_attention``,
``post_inter_attention_layernorm``, ``mlp``). The shared parts and `transformer_layer_spec` are here; each family's
spec is one function in its folder (megatron/models/gpt/layer_spec.py, bert/, t5/). An MoE model's GPT spec holds
`moe_mlp_builder` as its MLP part.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.attention import ParallelAttention
from megatron.layers.enums import AttnMaskType, AttnType
from megatron.layers.mlp import ParallelMLP
from megatron.layers.moe import SAME_AS_TP, MoELayer
from megatron.layers.norms import build_norm

Builder = Callable[[TransformerConfig, int, Optional[Any]], torch.nn.Module]


@dataclass(frozen=True)
class TransformerLayerSpec:
    """The parts of one transformer layer (builders called with (config, layer_number, tp_group))."""

    input_norm: Builder
    self_attention: Builder
    pre_mlp_norm: Builder
    mlp: Builder
    cross_attention: Optional[Builder] = None
    pre_cross_attention_norm: Optional[Builder] = None


def norm_builder(config: TransformerConfig, layer_number: int, tp_group: Optional[Any]) -> torch.nn.Module:
    """The config's norm (LayerNorm | RMSNorm) over the hidden size."""
    return build_norm(config)


def mlp_builder(config: TransformerConfig, layer_number: int, tp_group: Optional[Any]) -> torch.nn.Module:
    return ParallelMLP(config, tp_group)


def expert_group(config: TransformerConfig) -> Optional[Any]:
    """The expert-model-parallel group of the current parallel state (None without expert parallelism)."""
    if config.expert_model_parallel_size <= 1:
        return None
    state = parallel_state.get_parallel_state()
    if state.ep_size != config.expert_model_parallel_size:
        raise ValueError(f"--expert-model-parallel-size {config.expert_model_parallel_size} but the process groups "
                         f"were built with {state.ep_size}; initialize_model_parallel(expert_model_parallel_size=...)")
    return state.ep_group


def expert_tensor_group() -> Any:
    """The expert-tensor-parallel group of the current parallel state when it is not the dense TP group
    (--expert-tensor-parallel-size), else MoELayer's default (the TP group)."""
    if not parallel_state.model_parallel_is_initialized():
        return SAME_AS_TP
    state = parallel_state.get_parallel_state()
    return state.etp_group if state.expert_tp_differs else SAME_AS_TP


def moe_mlp_builder(config: TransformerConfig, layer_number: int, tp_group: Optional[Any]) -> torch.nn.Module:
    """The MoE MLP on the layers --moe-layer-freq marks, the dense MLP on the others; a multi-token-prediction
    layer (numbered after the decoder's) takes the kind of the decoder's last layer, as in Megatron-LM."""
    pattern = config.moe_layer_pattern
    if pattern[min(layer_number, len(pattern)) - 1]:
        return MoELayer(config, layer_number, tp_group, expert_group(config), config.moe_token_dispatcher_type,
                        etp_group=expert_tensor_group())
    return ParallelMLP(config, tp_group)


@dataclass(frozen=True)
class AttentionBuilder:
    """Builds a ParallelAttention of a given kind and mask type (a picklable builder)."""

    attention_type: AttnType = AttnType.self_attn
    attn_mask_type: AttnMaskType = AttnMaskType.causal

    def __call__(self, config: TransformerConfig, layer_number: int, tp_group: Optional[Any]) -> torch.nn.Module:
        return ParallelAttention(config, layer_number, tp_group, attention_type=self.attention_type,
                                 attn_mask_type=self.attn_mask_type)


def transformer_layer_spec(self_attn_mask_type: AttnMaskType = AttnMaskType.padding,
                           cross_attention: bool = False) -> TransformerLayerSpec:
    """Megatron's layer: norm -> self-attention [-> norm -> cross-attention] -> norm -> MLP."""
    return TransformerLayerSpec(
        input_norm=norm_builder,
        self_attention=AttentionBuilder(AttnType.self_attn, self_attn_mask_type),
        pre_mlp_norm=norm_builder,
        mlp=mlp_builder,
        cross_attention=AttentionBuilder(AttnType.cross_attn, AttnMaskType.padding) if cross_attention else None,
        pre_cross_attention_norm=norm_builder if cross_attention else None,
    )
