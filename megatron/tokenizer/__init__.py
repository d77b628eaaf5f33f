"""Tokenizers for every Megatron `--tokenizer-type` (no torch import: the preprocessing tool must start fast)."""
from megatron.tokenizer.abstract import AbstractTokenizer
from megatron.tokenizer.tokenizer import TOKENIZER_TYPES, build_tokenizer, vocab_size_with_padding

__all__ = ["AbstractTokenizer", "TOKENIZER_TYPES", "build_tokenizer", "vocab_size_with_padding"]
