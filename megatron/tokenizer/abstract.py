"""The tokenizer interface every `--tokenizer-type` implements (Megatron's AbstractTokenizer contract)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Dict, List, Optional, Sequence


class AbstractTokenizer(ABC):
    """Common interface: vocab_size, vocab, inv_vocab, tokenize, detokenize and the special ids.

    Special ids a tokenizer type does not have raise AttributeError (as Megatron does), except where Megatron
    returns a sentinel (NullTokenizer returns -1 for cls/sep/mask).
    """

    def __init__(self, name: str):
        self.name = name

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def vocab(self) -> Dict[str, int]: ...

    @property
    @abstractmethod
    def inv_vocab(self) -> Dict[int, str]: ...

    @abstractmethod
    def tokenize(self, text: str) -> List[int]: ...

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Tokenize many texts; subclasses override this with a batched engine call."""
        return [self.tokenize(t) for t in texts]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        raise NotImplementedError(f"detokenizer is not implemented for {self.name} tokenizer")

    def _missing(self, what: str):
        raise AttributeError(f"{what} is not provided for {self.name} tokenizer")

    @property
    def cls(self) -> int:
        return self._missing("CLS")

    @property
    def sep(self) -> int:
        return self._missing("SEP")

    @property
    def pad(self) -> int:
        return self._missing("PAD")

    @property
    def eod(self) -> int:
        return self._missing("EOD")

    @property
    def mask(self) -> int:
        return self._missing("MASK")

    @property
    def bos(self) -> int:
        return self._missing("BOS")

    @property
    def eos(self) -> int:
        return self._missing("EOS")

    @property
    def additional_special_tokens_ids(self) -> Optional[List[int]]:
        return []
