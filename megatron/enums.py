"""Stand-ins for Megatron-DeepSpeed's (BigScience's) ``megatron.enums`` so that the ``args`` pickled in its
checkpoints (``mp_rank_XX_model_states.pt`` of BLOOM's training runs: ``args.position_embedding_type =
PositionEmbeddingType.alibi``, ``args.attn_mask_type``) load through the safe loader (megatron/checkpoint/safe_load.py
allow-lists these classes). Same names and values as there; this project's own model enums are in
megatron/layers/enums.py, and `position_embedding_name` turns a member into our --position-embedding-type value.
"""
from __future__ import annotations

import enum
from typing import Any


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    prefix = 3
    custom = 4


class PositionEmbeddingType(enum.Enum):
    rotary = 1
    absolute = 2
    alibi = 3


def position_embedding_name(value: Any) -> Any:
    """Our --position-embedding-type value for a Megatron-DeepSpeed enum member or name (absolute ->
    learned_absolute, rotary -> rope, alibi); anything else unchanged."""
    if isinstance(value, enum.Enum):
        value = value.name
    return {"absolute": "learned_absolute", "rotary": "rope"}.get(value, value)
