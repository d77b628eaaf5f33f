"""TokenizerSettings: the tokenizer flags megatron/tokenizer/tokenizer.py reads, and the vocabulary padding's."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, flag_value, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
    """--tokenizer-type and its files, --vocab-extra-ids, --vocab-size (NullTokenizer) and the padding multiple."""

    settings: Settings = dataclasses.field(repr=False)
    # None (a converter's namespace) means no padding here, not the declared multiple
    make_vocab_size_divisible_by: int = 128
    rank: int = 0

    tokenizer_type = SettingValue()
    vocab_file = SettingValue()
    merge_file = SettingValue()
    tokenizer_model = SettingValue()
    tokenizer_name_or_path = SettingValue()
    vocab_extra_ids = SettingValue()
    vocab_size = SettingValue()
    tensor_model_parallel_size = SettingValue()
    sft_tokenizer_prompt_format = SettingValue()

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> TokenizerSettings:
        return from_settings(cls, args, settings,
                             make_vocab_size_divisible_by=flag_value(args, "make_vocab_size_divisible_by") or 1)
