"""The parts every model family shares, built from megatron.core tensor-parallel layers: attention, MLP, MoE, norms,
rotary, embeddings and stacks, layer specs (layer_specs.py) composed with the TransformerConfig. The families' models
live in megatron/models/<family>/. Megatron's old package ``megatron.model`` (``from megatron.model import GPTModel``)
is an alias of this one with the families' classes added (megatron/moved.py).

Parameter names follow Megatron's GPT checkpoints (language_model.embedding.word_embeddings.weight,
language_model.encoder.layers.{i}.self_attention.query_key_value.weight, ...).
"""
from megatron.layers.attention import CoreAttention, ParallelAttention
from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.layers.enums import AttnMaskType, AttnType, LayerType, ModelType
from megatron.layers.fused_layer_norm import LayerNorm, MixedFusedLayerNorm
from megatron.layers.fused_softmax import FusedScaleMaskSoftmax
from megatron.layers.inference_params import InferenceParams
from megatron.layers.language_model import Embedding, Pooler, TransformerLanguageModel, parallel_lm_logits
from megatron.layers.layer_specs import TransformerLayerSpec, transformer_layer_spec
from megatron.layers.module import (
    Float16Module,
    MegatronModule,
    float16_to_fp32,
    fp32_to_float16,
    param_is_not_shared,
    unwrap_model,
)
from megatron.layers.norms import RMSNorm, build_norm
from megatron.layers.rotary import RotaryEmbedding
from megatron.layers.transformer import (
    ParallelMLP,
    ParallelTransformer,
    ParallelTransformerLayer,
)

__all__ = [
    "CoreAttention",
    "ParallelAttention",
    "flatten_checkpoint_state_dict",
    "AttnMaskType",
    "AttnType",
    "LayerType",
    "ModelType",
    "LayerNorm",
    "MixedFusedLayerNorm",
    "FusedScaleMaskSoftmax",
    "InferenceParams",
    "Embedding",
    "Pooler",
    "TransformerLanguageModel",
    "parallel_lm_logits",
    "TransformerLayerSpec",
    "transformer_layer_spec",
    "Float16Module",
    "MegatronModule",
    "float16_to_fp32",
    "fp32_to_float16",
    "param_is_not_shared",
    "unwrap_model",
    "RMSNorm",
    "build_norm",
    "RotaryEmbedding",
    "ParallelMLP",
    "ParallelTransformer",
    "ParallelTransformerLayer",
]
