"""TokenizerSettings: the tokenizer flags megatron/tokenizer/tokenizer.py reads, and the vocabulary padding's."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args, flag_value


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
    """--tokenizer-type and its files, --vocab-extra-ids, --vocab-size (NullTokenizer) and the padding multiple."""

    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    tokenizer_name_or_path: Optional[str] = None
    vocab_extra_ids: int = 0
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    tensor_model_parallel_size: int = 1
    rank: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TokenizerSettings:
        # None (a converter's namespace) means no padding here, not the declared multiple
        return fill_from_args(cls, args,
                              make_vocab_size_divisible_by=flag_value(args, "make_vocab_size_divisible_by") or 1)
