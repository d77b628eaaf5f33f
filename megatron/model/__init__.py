"""The parts every model family shares, built from megatron.core tensor-parallel layers: attention, MLP, MoE, norms,
rotary, embeddings and stacks, layer specs (layer_specs.py) composed with the TransformerConfig. The families' models
live in megatron/models/<family>/; GPTModel, BertModel, T5Model stay importable from here (Megatron's paths).

Parameter names follow Megatron's GPT checkpoints (language_model.embedding.word_embeddings.weight,
language_model.encoder.layers.{i}.self_attention.query_key_value.weight, ...).
"""
import importlib
from typing import Any

from megatron.model.attention import CoreAttention, ParallelAttention
from megatron.model.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.model.enums import AttnMaskType, AttnType, LayerType, ModelType
from megatron.model.fused_layer_norm import LayerNorm, MixedFusedLayerNorm
from megatron.model.fused_softmax import FusedScaleMaskSoftmax
from megatron.model.inference_params import InferenceParams
from megatron.model.language_model import Embedding, Pooler, TransformerLanguageModel, parallel_lm_logits
from megatron.model.layer_specs import TransformerLayerSpec, transformer_layer_spec
from megatron.model.module import (
    Float16Module,
    MegatronModule,
    float16_to_fp32,
    fp32_to_float16,
    param_is_not_shared,
    unwrap_model,
)
from megatron.model.norms import RMSNorm, build_norm
from megatron.model.rotary import RotaryEmbedding
from megatron.model.transformer import (
    ParallelMLP,
    ParallelTransformer,
    ParallelTransformerLayer,
)

# Family classes re-exported here, imported on first use (the family modules import this package's shared parts).
_FAMILY_NAMES = {"BertModel": "megatron.models.bert.model", "T5Model": "megatron.models.t5.model",
                 "GPTModel": "megatron.models.gpt.model",
                 "post_language_model_processing": "megatron.models.gpt.model",
                 "gpt_layer_spec": "megatron.models.gpt.layer_spec", "bert_layer_spec": "megatron.models.bert.layer_spec"}


def __getattr__(name: str) -> Any:
    if name in _FAMILY_NAMES:
        return getattr(importlib.import_module(_FAMILY_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted([*globals(), *_FAMILY_NAMES])


__all__ = [
    "AttnMaskType",
    "AttnType",
    "BertModel",
    "CoreAttention",
    "Embedding",
    "Float16Module",
    "FusedScaleMaskSoftmax",
    "GPTModel",
    "InferenceParams",
    "LayerNorm",
    "LayerType",
    "MegatronModule",
    "MixedFusedLayerNorm",
    "ModelType",
    "ParallelAttention",
    "ParallelMLP",
    "ParallelTransformer",
    "ParallelTransformerLayer",
    "Pooler",
    "RMSNorm",
    "RotaryEmbedding",
    "T5Model",
    "TransformerLanguageModel",
    "TransformerLayerSpec",
    "bert_layer_spec",
    "build_norm",
    "flatten_checkpoint_state_dict",
    "float16_to_fp32",
    "fp32_to_float16",
    "gpt_layer_spec",
    "param_is_not_shared",
    "parallel_lm_logits",
    "post_language_model_processing",
    "transformer_layer_spec",
    "unwrap_model",
]
