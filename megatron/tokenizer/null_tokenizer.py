"""NullTokenizer: the text is already token ids separated by spaces (Megatron's `--tokenizer-type NullTokenizer`).

As in Megatron, `--vocab-size N` gives ids 0..N-1 plus one extra id N that is the end-of-document token, so
`tokenizer.vocab_size == N + 1` and `tokenizer.eod == tokenizer.vocab_size - 1 == N`; cls/sep/mask are -1.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from megatron.errors import ArgumentError
from megatron.tokenizer.abstract import AbstractTokenizer


class NullTokenizer(AbstractTokenizer):
    def __init__(self, vocab_size: int):
        super().__init__("NullTokenizer")
        try:
            n = int(vocab_size)
        except (TypeError, ValueError):
            raise ArgumentError(f"NullTokenizer: --vocab-size must be an integer, got {vocab_size!r}") from None
        if n <= 0:
            raise ArgumentError(f"NullTokenizer: --vocab-size must be positive, got {n}")
        self._vocab_size_without_eod = n
        self._eod_id = n

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def vocab(self) -> Dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: str(i) for i in range(self.vocab_size)}

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            bad = next(x for x in text.split() if not x.lstrip("-").isdigit())
            raise ValueError(f"NullTokenizer: text must be integer ids separated by spaces, found {bad[:40]!r}") from None
        for i in ids:
            if i < 0 or i >= self.vocab_size:
                raise ArgumentError(f"NullTokenizer: id {i} is outside [0, {self.vocab_size}) (raise --vocab-size)")
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return " ".join(str(int(x)) for x in token_ids)

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def additional_special_tokens_ids(self) -> Optional[List[int]]:
        return None
