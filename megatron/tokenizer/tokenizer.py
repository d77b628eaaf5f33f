"""`build_tokenizer(args)` for Megatron's `--tokenizer-type` values and Megatron's vocabulary padding."""
from __future__ import annotations

from typing import Any

from megatron.errors import ArgumentError
from megatron.tokenizer.abstract import AbstractTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer",
                   "Llama2Tokenizer", "PretrainedFromHF", "HuggingFaceTokenizer", "NullTokenizer")


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1, *, log: bool = False) -> int:
    """Round the vocab up to a multiple of make_vocab_size_divisible_by * tp (Megatron's _vocab_size_with_padding)."""
    multiple = int(make_vocab_size_divisible_by) * int(tensor_model_parallel_size)
    if multiple <= 0:
        raise ArgumentError(f"--make-vocab-size-divisible-by ({make_vocab_size_divisible_by}) times tensor parallel "
                            f"size ({tensor_model_parallel_size}) must be positive")
    padded = -(-int(orig_vocab_size) // multiple) * multiple
    if log:
        print(f" > padded vocab (size: {orig_vocab_size}) with {padded - orig_vocab_size} dummy tokens "
              f"(new size: {padded})", flush=True)
    return padded


def _vocab_size_with_padding(orig_vocab_size: int, args: Any) -> int:
    """Megatron's name and signature: pads with args.make_vocab_size_divisible_by * tp and logs on rank 0."""
    return vocab_size_with_padding(orig_vocab_size, getattr(args, "make_vocab_size_divisible_by", 128) or 1,
                                   getattr(args, "tensor_model_parallel_size", 1) or 1,
                                   log=(getattr(args, "rank", 0) or 0) == 0)


def _make(args: Any) -> AbstractTokenizer:
    kind = getattr(args, "tokenizer_type", None)
    extra = int(getattr(args, "vocab_extra_ids", 0) or 0)
    if kind == "GPT2BPETokenizer":
        from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(getattr(args, "vocab_file", None), getattr(args, "merge_file", None))
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

        return BertWordPieceTokenizer(getattr(args, "vocab_file", None), lower_case=kind.endswith("LowerCase"),
                                      vocab_extra_ids=extra)
    if kind == "SentencePieceTokenizer":
        from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(getattr(args, "tokenizer_model", None), vocab_extra_ids=extra)
    if kind == "Llama2Tokenizer":
        from megatron.tokenizer.llama2_tokenizer import Llama2Tokenizer

        return Llama2Tokenizer(getattr(args, "tokenizer_model", None), vocab_extra_ids=extra)
    if kind == "PretrainedFromHF":
        from megatron.tokenizer.hf_tokenizer import PretrainedFromHFTokenizer

        return PretrainedFromHFTokenizer(getattr(args, "tokenizer_name_or_path", None), vocab_extra_ids=extra)
    if kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.hf_tokenizer import HuggingFaceTokenizer

        return HuggingFaceTokenizer(getattr(args, "tokenizer_model", None), vocab_extra_ids=extra)
    if kind == "NullTokenizer":
        from megatron.tokenizer.null_tokenizer import NullTokenizer

        if getattr(args, "vocab_size", None) is None:
            raise ArgumentError("NullTokenizer needs --vocab-size")
        return NullTokenizer(args.vocab_size)
    raise ArgumentError(f"--tokenizer-type {kind!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}")


def build_tokenizer(args: Any) -> AbstractTokenizer:
    """Build the tokenizer named by args.tokenizer_type and set args.padded_vocab_size (prints on rank 0)."""
    rank = getattr(args, "rank", 0) or 0
    if rank == 0:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
    tokenizer = _make(args)
    args.padded_vocab_size = _vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer
