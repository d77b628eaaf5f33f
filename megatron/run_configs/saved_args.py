"""SavedRunArgs: what the checkpoint readers take from the ``args`` a checkpoint was saved with.

A checkpoint's ``args`` may come from any Megatron version (or be missing): every field is read here with the
default an absent one means, so the readers in megatron/checkpoint/conversion/ never probe the namespace themselves.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

from megatron.run_configs.declared import SettingValue, from_settings
from megatron.settings.values import Settings

TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model", "tokenizer_name_or_path")
# Run counters (0 when absent) and other Megatron versions' fields no flag here declares (None when absent).
COUNTERS = ("consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens", "consumed_valid_tokens")
OTHER_VERSIONS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "transformer_impl")


@dataclasses.dataclass(frozen=True)
class SavedRunArgs:
    """The saved run's tokenizer, vocabulary padding, counters, parallel sizes and core architecture numbers."""

    settings: Settings = dataclasses.field(repr=False)  # the saved run's settings
    tokenizer: tuple[tuple[str, Any], ...] = ()  # ("vocab_file", ...), ("type", tokenizer_type): the set ones
    true_vocab_size: Optional[int] = None
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    consumed_train_tokens: int = 0
    consumed_valid_tokens: int = 0
    # None: a checkpoint that does not say (the readers then take the layout from the files), not the flag's 1
    tensor_model_parallel_size: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    transformer_impl: Optional[str] = None

    make_vocab_size_divisible_by = SettingValue()
    expert_model_parallel_size = SettingValue()
    pipeline_model_parallel_size = SettingValue()
    expert_tensor_parallel_size = SettingValue()
    pipeline_model_parallel_split_rank = SettingValue()  # T5: the first decoder stage
    num_experts = SettingValue()
    num_layers_per_virtual_pipeline_stage = SettingValue()
    encoder_num_layers = SettingValue()
    decoder_num_layers = SettingValue()
    num_layers = SettingValue()
    hidden_size = SettingValue()
    num_attention_heads = SettingValue()

    def tokenizer_dict(self) -> dict[str, Any]:
        return dict(self.tokenizer)

    @classmethod
    def from_args(cls, args: Optional[argparse.Namespace], settings: Optional[Settings] = None) -> SavedRunArgs:
        tok = [(key, getattr(args, key)) for key in TOKENIZER_FILES if getattr(args, key, None)]
        if getattr(args, "tokenizer_type", None):
            tok.append(("type", args.tokenizer_type))
        if getattr(args, "tokenizer_type", None) == "SFTTokenizer":  # its chat template goes into a HF export
            tok.append(("sft_tokenizer_prompt_format", getattr(args, "sft_tokenizer_prompt_format", None)))
        return from_settings(
            cls, args, settings,
            tokenizer=tuple(tok),
            tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", None),
            **{name: getattr(args, name, 0) for name in COUNTERS},
            **{name: getattr(args, name, None) for name in OTHER_VERSIONS},
        )
