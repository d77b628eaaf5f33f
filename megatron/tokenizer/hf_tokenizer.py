"""Hugging Face tokenizers: `PretrainedFromHF` (`--tokenizer-name-or-path`, Megatron-DeepSpeed) and `HuggingFaceTokenizer`
(`--tokenizer-model`, Megatron-LM's name for the same thing).

Works offline: a local directory (tokenizer.json / tokenizer_config.json …) or a hub name already in the local HF
cache; anything else is a one-line error. As in Megatron-DeepSpeed, `tokenize` is `tokenizer.encode(text)` (so the
model's own BOS/EOS conventions apply), vocab_size is `len(tokenizer)`, eod is the EOS id and `vocab_extra_ids`
adds "<extra_id_N>" additional special tokens.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

from megatron.errors import InputFileError
from megatron.tokenizer.abstract import AbstractTokenizer
from megatron.tokenizer.chat_format import ChatFormat


class TokenizerLoadError(InputFileError, RuntimeError):
    """transformers could not load the tokenizer folder/name given (a RuntimeError, as before)."""


class PretrainedFromHFTokenizer(AbstractTokenizer):
    _flag = "--tokenizer-name-or-path"
    _type = "PretrainedFromHF"

    def __init__(self, name_or_path: str, vocab_extra_ids: int = 0):
        super().__init__(str(name_or_path))
        if not name_or_path:
            raise InputFileError(f"{self._type} needs {self._flag} (a local tokenizer directory)")
        from transformers import AutoTokenizer

        kwargs = {}
        if vocab_extra_ids:
            kwargs["additional_special_tokens"] = [f"<extra_id_{i}>" for i in range(int(vocab_extra_ids))]
        local = os.path.isdir(name_or_path)
        try:
            self._tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=not local, **kwargs)
        except (OSError, ValueError) as exc:
            where = "directory" if local else "name (not a local directory and not in the local Hugging Face cache)"
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TokenizerLoadError(f"{self._flag} {name_or_path}: cannot load a tokenizer from this {where}; "
                               f"pass a directory saved with save_pretrained() ({msg})") from None
        self._extra = kwargs.get("additional_special_tokens", [])
        self._vocab_cache: Dict[str, int] = {}

    @property
    def hf_tokenizer(self):
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def vocab(self) -> Dict[str, int]:
        if not self._vocab_cache:
            self._vocab_cache = dict(self._tok.get_vocab())
        return self._vocab_cache

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return list(self._tok.encode(text))

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if not texts:
            return []
        return [list(ids) for ids in self._tok(list(texts))["input_ids"]]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in token_ids])

    def _special(self, attr: str, what: str) -> int:
        value = getattr(self._tok, attr, None)
        if value is None:
            raise AttributeError(f"{what} is not provided by the tokenizer at {self.name}")
        return value

    @property
    def cls(self) -> int:
        return self._special("cls_token_id", "CLS")

    @property
    def sep(self) -> int:
        return self._special("sep_token_id", "SEP")

    @property
    def pad(self) -> int:
        return self._special("pad_token_id", "PAD")

    @property
    def mask(self) -> int:
        return self._special("mask_token_id", "MASK")

    @property
    def bos(self) -> int:
        return self._special("bos_token_id", "BOS")

    @property
    def eos(self) -> int:
        return self._special("eos_token_id", "EOS")

    @property
    def eod(self) -> int:
        return self.eos

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return [self._tok.convert_tokens_to_ids(t) for t in self._extra]


class HuggingFaceTokenizer(PretrainedFromHFTokenizer):
    """Megatron-LM's `--tokenizer-type HuggingFaceTokenizer --tokenizer-model <folder with tokenizer.json>`.

    Same behaviour as PretrainedFromHF (AutoTokenizer; `tokenize` adds the tokenizer's own special tokens, e.g. Llama's
    BOS; eod is the EOS id); only the flag naming the folder differs.
    """

    _flag = "--tokenizer-model"
    _type = "HuggingFaceTokenizer"


class SFTTokenizer(HuggingFaceTokenizer):
    """Megatron-LM's `--tokenizer-type SFTTokenizer --tokenizer-model FOLDER --sft-tokenizer-prompt-format NAME`:
    the HuggingFaceTokenizer plus the prompt format's conversation rendering (`tokenize_conversation`) and pad id."""

    _type = "SFTTokenizer"

    def __init__(self, name_or_path: str, prompt_format: str = "nemotron-h-aligned", vocab_extra_ids: int = 0):
        super().__init__(name_or_path, vocab_extra_ids=vocab_extra_ids)
        self.chat = ChatFormat(self._tok, prompt_format, eod=self.eod)

    @property
    def pad(self) -> int:
        return self.chat.pad

    def tokenize_conversation(self, conversation: List[dict], return_target: bool, add_generation_prompt: bool):
        """Megatron's SFTTokenizer.tokenize_conversation (megatron/tokenizer/chat_format.py)."""
        return self.chat.tokenize_conversation(conversation, return_target, add_generation_prompt)
