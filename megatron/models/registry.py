"""The Hugging Face adapter registry: one line per adapter, each defined in its own module of its family's folder.
The HF loader finds an adapter by the ``architectures`` name in config.json, the HF saver by --model-type and the
adapter that accepts the stored architecture."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from megatron.models.bert.hf import BERT
from megatron.models.gpt.hf_bloom import BLOOM
from megatron.models.gpt.hf_gpt2 import GPT2
from megatron.models.gpt.hf_llama import LLAMA
from megatron.models.gpt.hf_moe import MOE
from megatron.models.hf_adapter import HFAdapter

ADAPTERS: Tuple[HFAdapter, ...] = (GPT2, LLAMA, MOE, BLOOM, BERT)


def supported_architectures() -> Tuple[str, ...]:
    """Every HF architecture name some adapter reads, in registry order."""
    return tuple(name for adapter in ADAPTERS for name in adapter.architectures)


def adapter_for_architecture(name: Optional[str]) -> Optional[HFAdapter]:
    """The adapter reading config.json's architecture `name` (None: no adapter)."""
    return next((a for a in ADAPTERS if name in a.architectures), None)


def adapters_for_model_type(model_type: str) -> Tuple[HFAdapter, ...]:
    """The adapters whose saver writes `model_type` models, in registry order."""
    return tuple(a for a in ADAPTERS if a.model_type == model_type)


def adapter_for_model(model_type: str, architecture: Dict[str, Any]) -> Optional[HFAdapter]:
    """The adapter whose saver writes a `model_type` model of these architecture fields (None: none does)."""
    return next((a for a in adapters_for_model_type(model_type) if a.accepts(architecture)), None)


def model_types() -> Tuple[str, ...]:
    """The Megatron model types some adapter converts, in registry order."""
    return tuple(dict.fromkeys(a.model_type for a in ADAPTERS))
