"""TokenizerSettings: the tokenizer flags megatron/tokenizer/tokenizer.py reads, and the vocabulary padding's."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional


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
        return cls(
            tokenizer_type=getattr(args, "tokenizer_type", None),
            vocab_file=getattr(args, "vocab_file", None),
            merge_file=getattr(args, "merge_file", None),
            tokenizer_model=getattr(args, "tokenizer_model", None),
            tokenizer_name_or_path=getattr(args, "tokenizer_name_or_path", None),
            vocab_extra_ids=int(getattr(args, "vocab_extra_ids", 0) or 0),
            vocab_size=getattr(args, "vocab_size", None),
            make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128) or 1,
            tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1) or 1,
            rank=getattr(args, "rank", 0) or 0,
        )
