"""MemorySettings: the optional flags megatron/theoretical_memory_usage.py's start-up estimate reads."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class MemorySettings:
    """Model family, optimizer, precision, batch and parallel sizes and recompute choices the estimate depends on
    (absent flags: defaults); the model's shape comes from its TransformerConfig."""

    settings: Settings = dataclasses.field(repr=False)
    padded_vocab_size: int = 0
    data_parallel_size: int = 1
    model_family: str = "gpt"
    virtual_pipeline_model_parallel_size: Optional[int] = None

    seq_length = SettingValue(when_none=1)
    micro_batch_size = SettingValue(when_none=1)
    hidden_size = SettingValue(when_none=1)
    num_layers = SettingValue(when_none=1)
    tensor_model_parallel_size = SettingValue()
    pipeline_model_parallel_size = SettingValue()
    sequence_parallel = SettingValue()
    fp16 = SettingValue()
    bf16 = SettingValue()
    recompute_method = SettingValue()
    recompute_num_layers = SettingValue()
    bert_binary_head = SettingValue()
    accumulate_allreduce_grads_in_fp32 = SettingValue()
    optimizer = SettingValue()
    use_distributed_optimizer = SettingValue()
    context_parallel_size = SettingValue()
    distribute_saved_activations = SettingValue()
    recompute_granularity = SettingValue()
    expert_model_parallel_size = SettingValue()
    expert_tensor_parallel_size = SettingValue()  # None: the tensor-parallel size (Megatron-LM's default)

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> MemorySettings:
        return from_settings(cls, args, settings)
