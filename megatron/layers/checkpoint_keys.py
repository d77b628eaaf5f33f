"""The keys of Megatron's model checkpoints that every family shares: the language model's key, the last pipeline
stage's copy of the tied word embeddings, and the nested checkpoint dict -> flat module names (older and Megatron
Core names included)."""
from __future__ import annotations

from typing import Any, Mapping

from megatron.layers.mcore_names import core_to_ours, has_core_names

WORD_EMBEDDINGS_FOR_HEAD_KEY = "word_embeddings_for_head"
OUTPUT_COPY = "language_model.output_layer.weight"
LANGUAGE_MODEL_KEY = "language_model"
# saved buffers (no gradient, no optimizer state): the MoE router's aux-loss-free expert bias (megatron/layers/moe.py);
# and Transformer Engine's _extra_state entries
STATE_ONLY_SUFFIXES = ("mlp.router.expert_bias", "_extra_state")
MTP_KEY = "mtp"  # the multi-token-prediction block of a last stage (megatron/layers/mtp.py), Megatron Core's name


def flatten_checkpoint_state_dict(state_dict: Mapping[str, Any]) -> dict:
    """Megatron's nested checkpoint dict -> flat module names (also accepts an already flat dict)."""
    flat: dict = {}

    def walk(prefix: str, node: Mapping[str, Any]) -> None:
        for key, value in node.items():
            if key == WORD_EMBEDDINGS_FOR_HEAD_KEY and not prefix:
                key = "word_embeddings"
            if key == "transformer" and prefix == LANGUAGE_MODEL_KEY + ".":
                key = "encoder"  # Megatron checkpoints before the encoder/decoder split
            name = f"{prefix}{key}"
            if isinstance(value, Mapping):
                walk(name + ".", value)
            else:
                flat[name] = value

    walk("", state_dict)
    if has_core_names(flat):  # Megatron Core's names (its per-rank `torch` checkpoints)
        return core_to_ours(flat)
    # older checkpoints call self-attention "attention"
    return {k.replace(".attention.", ".self_attention."): v for k, v in flat.items()}
