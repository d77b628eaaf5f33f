"""MemorySettings: the optional flags megatron/theoretical_memory_usage.py's start-up estimate reads."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional


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
    recompute_num_layers: Optional[int] = None
    model_family: str = "gpt"
    bert_binary_head: bool = True
    accumulate_allreduce_grads_in_fp32: bool = False
    optimizer: str = "adam"
    use_distributed_optimizer: bool = False
    context_parallel_size: int = 1
    distribute_saved_activations: bool = False
    recompute_granularity: Optional[str] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MemorySettings:
        return cls(
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, hidden_size=args.hidden_size,
            num_layers=args.num_layers, padded_vocab_size=args.padded_vocab_size,
            tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            data_parallel_size=args.data_parallel_size,
            sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
            fp16=bool(args.fp16), bf16=bool(args.bf16),
            recompute_method=getattr(args, "recompute_method", None),
            recompute_num_layers=getattr(args, "recompute_num_layers", None),
            model_family=getattr(args, "model_family", "gpt"),
            bert_binary_head=bool(getattr(args, "bert_binary_head", True)),
            accumulate_allreduce_grads_in_fp32=bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False)),
            optimizer=getattr(args, "optimizer", "adam"),
            use_distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
            context_parallel_size=getattr(args, "context_parallel_size", 1) or 1,
            distribute_saved_activations=bool(getattr(args, "distribute_saved_activations", False)),
            recompute_granularity=getattr(args, "recompute_granularity", None),
            virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
        )
