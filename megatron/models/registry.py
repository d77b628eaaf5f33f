"""The family registry: one line per Hugging Face adapter, each defined in its own module of its family's folder,
and one per checkpoint layout (each family's checkpoint_layout.py). The HF loader finds an adapter by the
``architectures`` name in config.json, the HF saver by --model-type and the adapter that accepts the stored
architecture; the checkpoint format code finds a family's layout by --model-type, by a model's class or by the names a
checkpoint holds."""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

from megatron.checkpoint.conversion.family_layout import CheckpointLayout
from megatron.models.bert.checkpoint_layout import BERT_LAYOUT
from megatron.models.bert.hf import BERT
from megatron.models.deepseek.hf_deepseek_v3 import DEEPSEEK_V3
from megatron.models.gpt.checkpoint_layout import GPT_LAYOUT
from megatron.models.gpt.hf_bloom import BLOOM
from megatron.models.gpt.hf_gpt2 import GPT2
from megatron.models.gpt.hf_gpt_oss import GPT_OSS
from megatron.models.gpt.hf_llama import LLAMA
from megatron.models.gpt.hf_moe import MOE
from megatron.models.hf_adapter import HFAdapter
from megatron.models.t5.checkpoint_layout import T5_LAYOUT

ADAPTERS: Tuple[HFAdapter, ...] = (GPT2, DEEPSEEK_V3, LLAMA, MOE, GPT_OSS, BLOOM, BERT)
# the first is the default (a model or checkpoint no other family claims); a family whose markers another family's
# checkpoints hold too comes before it (T5's last stage has an lm_head, as BERT's)
LAYOUTS: Tuple[CheckpointLayout, ...] = (GPT_LAYOUT, T5_LAYOUT, BERT_LAYOUT)


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


def declared_layout(model_type: str) -> Optional[CheckpointLayout]:
    """The checkpoint layout a family declares for --model-type `model_type` (None: no family does)."""
    return next((layout for layout in LAYOUTS if layout.model_type == model_type), None)


def layout_for(model_type: str) -> CheckpointLayout:
    """The checkpoint layout of --model-type `model_type` (the default family's for a type no family declares)."""
    return declared_layout(model_type) or LAYOUTS[0]


def layout_of_model(model: Any) -> CheckpointLayout:
    """The checkpoint layout of an (unwrapped) model, by its class (the default family's for any other model)."""
    return next((layout for layout in LAYOUTS if layout.model_class is not None and isinstance(model, layout.model_class)),
                LAYOUTS[0])


def layout_holding(names: Iterable[str]) -> CheckpointLayout:
    """The checkpoint layout whose markers flat names (a last stage's, or a whole model's) hold (else the default)."""
    names = list(names)
    return next((layout for layout in LAYOUTS if layout.holds(names)), LAYOUTS[0])
