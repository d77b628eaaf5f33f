"""Data and tokenizer settings (--help group "data and dataloader")."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, List, Optional

from megatron.settings.declare import setting


def _tokenizer_types() -> List[str]:
    """The --tokenizer-type choices: whatever megatron.tokenizer supports (megatron/tokenizer/types.py)."""
    from megatron.tokenizer.types import TOKENIZER_TYPES

    return list(TOKENIZER_TYPES)


@dataclasses.dataclass
class DataSettings:
    """--help group "data and dataloader"."""

    TITLE: ClassVar[str] = "data and dataloader"
    data_path: Optional[List[str]] = setting("--data-path", nargs="*",
        help="Dataset prefix, or weighted prefixes: 'w1 prefix1 w2 prefix2 ...'.", read_by="pretrain_gpt.py")
    split: str = setting("--split", default="969, 30, 1", help="Train/valid/test split, e.g. '949,50,1'.",
        read_by="pretrain_gpt.py")
    train_data_path: Optional[List[str]] = setting("--train-data-path", nargs="*",
        help="Separate training data prefix(es).", read_by="pretrain_gpt.py")
    valid_data_path: Optional[List[str]] = setting("--valid-data-path", nargs="*",
        help="Separate validation data prefix(es).", read_by="pretrain_gpt.py")
    test_data_path: Optional[List[str]] = setting("--test-data-path", nargs="*", help="Separate test data prefix(es).",
        read_by="pretrain_gpt.py")
    data_cache_path: Optional[str] = setting("--data-cache-path", help="Where to store index-mapping caches.",
        read_by="pretrain_gpt.py")
    vocab_size: Optional[int] = setting("--vocab-size", help="Vocabulary size (NullTokenizer / no vocab file).",
        read_by="megatron/tokenizer/tokenizer.py")
    vocab_file: Optional[str] = setting("--vocab-file", help="Vocabulary file.",
        read_by="megatron/tokenizer/tokenizer.py")
    merge_file: Optional[str] = setting("--merge-file", help="BPE merges file.",
        read_by="megatron/tokenizer/tokenizer.py")
    vocab_extra_ids: int = setting("--vocab-extra-ids", default=0, help="Extra sentinel tokens (T5).",
        read_by="megatron/tokenizer/tokenizer.py")
    seq_length: Optional[int] = setting("--seq-length", help="Maximum sequence length.", read_by="pretrain_gpt.py",
        restore_if_unset=True)
    encoder_seq_length: Optional[int] = setting("--encoder-seq-length", help="Encoder sequence length (T5/BERT).",
        read_by="megatron/arguments.py")
    decoder_seq_length: Optional[int] = setting("--decoder-seq-length", help="Decoder sequence length (T5).",
        families=("t5",))
    sample_rate: float = setting("--sample-rate", default=1.0, help="Fraction of data to use (0, 1].",
        refused="is not implemented (it subsamples BERT/T5 data in Megatron)")
    mask_prob: float = setting("--mask-prob", default=0.15, help="Masking probability (BERT/T5).",
        families=("bert", "t5"))
    short_seq_prob: float = setting("--short-seq-prob", default=0.1, help="Probability of a short sequence (BERT).",
        families=("bert", "t5"))
    mmap_warmup: bool = setting("--mmap-warmup", default=False, help="Warm up the memory-mapped dataset files.",
        read_by="pretrain_gpt.py")
    num_workers: int = setting("--num-workers", default=2, help="Dataloader worker processes.",
        read_by="megatron/training.py")
    tokenizer_type: Optional[str] = setting("--tokenizer-type", choices=_tokenizer_types, help="Tokenizer.",
        read_by="megatron/tokenizer/tokenizer.py", restore_if_unset=True)
    tokenizer_model: Optional[str] = setting("--tokenizer-model",
        help="SentencePiece model file, or the folder of a HuggingFaceTokenizer (--use-checkpoint-args takes the "
             "checkpoint's when not given, as Megatron-LM does).",
        read_by="megatron/tokenizer/tokenizer.py", restore_if_unset=True)
    tokenizer_name_or_path: Optional[str] = setting("--tokenizer-name-or-path",
        help="Hugging Face tokenizer name or directory (HFTokenizer).", read_by="megatron/tokenizer/tokenizer.py")
    data_impl: str = setting("--data-impl", "--dataset-impl", default="infer",
        choices=["mmap", "infer", "lazy", "cached"], help="Indexed dataset implementation.", read_by="pretrain_gpt.py")
    reset_position_ids: bool = setting("--reset-position-ids", default=False,
        help="Restart position ids after each EOD.", read_by="pretrain_gpt.py")
    reset_attention_mask: bool = setting("--reset-attention-mask", default=False,
        help="Do not attend across EOD tokens.", read_by="pretrain_gpt.py")
    eod_mask_loss: bool = setting("--eod-mask-loss", default=False, help="No loss on EOD tokens.",
        read_by="pretrain_gpt.py")
    sft: bool = setting("--sft", default=False,
        help="Megatron SFT training: --data-path names JSONL files of {\"messages\": [...]} conversations, packed "
             "with the loss on assistant tokens only (docs/sft.md).", read_by="pretrain_gpt.py", families=("gpt",))
    sft_tokenizer_prompt_format: str = setting("--sft-tokenizer-prompt-format", default="nemotron-h-aligned",
        help="SFT prompt format: one of Megatron's named formats, or 'hf' for the tokenizer's own chat_template "
             "(megatron/tokenizer/chat_format.py).", read_by="megatron/tokenizer/tokenizer.py", families=("gpt",))
