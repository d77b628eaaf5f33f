"""The GPT family's checkpoint layout (GPT-2, the Llama family with its MoE members, BLOOM): the decoder stack every
family shares, with no module of its own (megatron/checkpoint/conversion/family_layout.py's defaults)."""
from __future__ import annotations

from megatron.checkpoint.conversion.family_layout import CheckpointLayout

GPT_LAYOUT = CheckpointLayout(model_type="GPT")
