"""`build_tokenizer(args)` for Megatron's `--tokenizer-type` values and Megatron's vocabulary padding."""
from __future__ import annotations

from typing import Any

from megatron.errors import ArgumentError
from megatron.run_configs.tokenizer import TokenizerSettings
from megatron.tokenizer.abstract import AbstractTokenizer
from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HuggingFaceTokenizer, PretrainedFromHFTokenizer, SFTTokenizer
from megatron.tokenizer.llama2_tokenizer import Llama2Tokenizer
from megatron.tokenizer.null_tokenizer import NullTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron.tokenizer.types import TOKENIZER_TYPES


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
    return padded_vocab_size(orig_vocab_size, TokenizerSettings.from_args(args))


def padded_vocab_size(orig_vocab_size: int, settings: TokenizerSettings) -> int:
    """The vocabulary padded to make_vocab_size_divisible_by * tp (logged on rank 0)."""
    return vocab_size_with_padding(orig_vocab_size, settings.make_vocab_size_divisible_by,
                                   settings.tensor_model_parallel_size, log=settings.rank == 0)


def make_tokenizer(cfg: TokenizerSettings) -> AbstractTokenizer:
    """The tokenizer named by ``cfg.tokenizer_type`` (no vocabulary padding, no log line)."""
    kind = cfg.tokenizer_type
    extra = cfg.vocab_extra_ids
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(cfg.vocab_file, lower_case=kind.endswith("LowerCase"), vocab_extra_ids=extra)
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(cfg.tokenizer_model, vocab_extra_ids=extra)
    if kind == "Llama2Tokenizer":
        return Llama2Tokenizer(cfg.tokenizer_model, vocab_extra_ids=extra)
    if kind == "PretrainedFromHF":
        return PretrainedFromHFTokenizer(cfg.tokenizer_name_or_path, vocab_extra_ids=extra)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(cfg.tokenizer_model, vocab_extra_ids=extra)
    if kind == "SFTTokenizer":
        return SFTTokenizer(cfg.tokenizer_model, cfg.sft_tokenizer_prompt_format or "nemotron-h-aligned",
                            vocab_extra_ids=extra)
    if kind == "NullTokenizer":
        if cfg.vocab_size is None:
            raise ArgumentError("NullTokenizer needs --vocab-size")
        return NullTokenizer(cfg.vocab_size)
    raise ArgumentError(f"--tokenizer-type {kind!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}")


def build_tokenizer_from(cfg: TokenizerSettings) -> tuple[AbstractTokenizer, int]:
    """The tokenizer and the padded vocabulary size (prints on rank 0, as Megatron's build_tokenizer)."""
    if cfg.rank == 0:
        print(f"> building {cfg.tokenizer_type} tokenizer ...", flush=True)
    tokenizer = make_tokenizer(cfg)
    return tokenizer, padded_vocab_size(tokenizer.vocab_size, cfg)


def build_tokenizer(args: Any) -> AbstractTokenizer:
    """Megatron's API: build the tokenizer named by args.tokenizer_type and set args.padded_vocab_size (prints on
    rank 0)."""
    tokenizer, args.padded_vocab_size = build_tokenizer_from(TokenizerSettings.from_args(args))
    return tokenizer
