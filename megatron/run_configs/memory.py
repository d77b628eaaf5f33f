"""MemorySettings: the optional flags megatron/theoretical_memory_usage.py's start-up estimate reads."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args


@dataclasses.dataclass(frozen=True)
class MemorySettings:
    """Model family, optimizer, precision, batch and parallel sizes and recompute choices the estimate depends on
    (absent flags: defaults); the model's shape comes from its TransformerConfig."""

    seq_length: int = 1
    micro_batch_size: int = 1
    hidden_size: int = 1
    num_layers: int = 1
    padded_vocab_size: int = 0
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    sequence_parallel: bool = False
    fp16: bool = False
    bf16: bool = False
    recompute_method: Optional[str] = None
    recompute_num_layers: int = 1
    model_family: str = "gpt"
    bert_binary_head: bool = True
    accumulate_allreduce_grads_in_fp32: bool = False
    optimizer: str = "adam"
    use_distributed_optimizer: bool = False
    context_parallel_size: int = 1
    distribute_saved_activations: bool = False
    recompute_granularity: Optional[str] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # None: the tensor-parallel size (Megatron-LM's default)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MemorySettings:
        return fill_from_args(cls, args)
