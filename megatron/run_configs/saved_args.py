"""SavedRunArgs: what the checkpoint readers take from the ``args`` a checkpoint was saved with.

A checkpoint's ``args`` may come from any Megatron version (or be missing): every field is read here with the
default an absent one means, so the readers in megatron/checkpoint/conversion/ never probe the namespace themselves.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model")


@dataclasses.dataclass(frozen=True)
class SavedRunArgs:
    """The saved run's tokenizer, vocabulary padding, counters, parallel sizes and core architecture numbers."""

    tokenizer: tuple[tuple[str, Any], ...] = ()  # ("vocab_file", ...), ("type", tokenizer_type): the set ones
    true_vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    consumed_train_tokens: int = 0
    consumed_valid_tokens: int = 0
    expert_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    tensor_model_parallel_size: Optional[int] = None
    expert_tensor_parallel_size: Optional[int] = None
    pipeline_model_parallel_split_rank: Optional[int] = None  # T5: the first decoder stage
    num_experts: Optional[int] = None
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    transformer_impl: Optional[str] = None
    encoder_num_layers: Optional[int] = None
    decoder_num_layers: Optional[int] = None
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None

    def tokenizer_dict(self) -> dict[str, Any]:
        return dict(self.tokenizer)

    @classmethod
    def from_args(cls, args: Optional[argparse.Namespace]) -> SavedRunArgs:
        tok = [(key, getattr(args, key)) for key in TOKENIZER_FILES if getattr(args, key, None)]
        if getattr(args, "tokenizer_type", None):
            tok.append(("type", args.tokenizer_type))
        return cls(
            tokenizer=tuple(tok),
            true_vocab_size=getattr(args, "true_vocab_size", None),
            make_vocab_size_divisible_by=int(getattr(args, "make_vocab_size_divisible_by", 128) or 128),
            consumed_train_samples=getattr(args, "consumed_train_samples", 0),
            consumed_valid_samples=getattr(args, "consumed_valid_samples", 0),
            consumed_train_tokens=getattr(args, "consumed_train_tokens", 0),
            consumed_valid_tokens=getattr(args, "consumed_valid_tokens", 0),
            expert_model_parallel_size=int(getattr(args, "expert_model_parallel_size", 1) or 1),
            pipeline_model_parallel_size=int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
            tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", None),
            expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
            pipeline_model_parallel_split_rank=getattr(args, "pipeline_model_parallel_split_rank", None),
            num_experts=getattr(args, "num_experts", None),
            num_layers_per_virtual_pipeline_stage=getattr(args, "num_layers_per_virtual_pipeline_stage", None),
            decoder_first_pipeline_num_layers=getattr(args, "decoder_first_pipeline_num_layers", None),
            decoder_last_pipeline_num_layers=getattr(args, "decoder_last_pipeline_num_layers", None),
            transformer_impl=getattr(args, "transformer_impl", None),
            encoder_num_layers=getattr(args, "encoder_num_layers", None),
            decoder_num_layers=getattr(args, "decoder_num_layers", None),
            num_layers=getattr(args, "num_layers", None),
            hidden_size=getattr(args, "hidden_size", None),
            num_attention_heads=getattr(args, "num_attention_heads", None),
        )
