"""`--tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model`: Llama's SentencePiece model, Megatron-LM semantics.

As Megatron-LM's Llama2Tokenizer (and Meta's reference tokenizer): the vocab is exactly the model's pieces (nothing
appended), `tokenize(text)` is `[bos] + sentencepiece.encode(text)` (text completion: BOS, no EOS; literal "<s>" in
the text is ordinary text, not BOS), `eod` is the model's EOS id (so `--append-eod` ends a document with `</s>`),
cls/sep/mask are -1, and `detokenize` is sentencepiece's decode (BOS/EOS ids decode to nothing).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from megatron.errors import ArgumentError, InputFileError, InputFileNotFoundError
from megatron.tokenizer.abstract import AbstractTokenizer


class Llama2Tokenizer(AbstractTokenizer):
    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__("Llama2Tokenizer")
        if not model_file:
            raise InputFileError("Llama2Tokenizer needs --tokenizer-model (the model's SentencePiece tokenizer.model)")
        if vocab_extra_ids:
            raise ArgumentError(f"--vocab-extra-ids {vocab_extra_ids} is not supported with --tokenizer-type "
                             "Llama2Tokenizer (its vocab is the SentencePiece model's); drop the flag")
        import sentencepiece

        try:
            with open(model_file, "rb") as f:
                proto = f.read()
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        except FileNotFoundError:
            raise InputFileNotFoundError(f"--tokenizer-model {model_file}: file not found") from None
        except (RuntimeError, IsADirectoryError) as exc:
            raise InputFileError(f"--tokenizer-model {model_file}: not a SentencePiece model ({exc})") from None
        sp = self._sp
        self._bos_id, self._eos_id, self._pad_id = sp.bos_id(), sp.eos_id(), sp.pad_id()
        for what, value in (("BOS", self._bos_id), ("EOS", self._eos_id)):
            if value < 0:
                raise InputFileError(f"--tokenizer-model {model_file}: the SentencePiece model has no {what} piece, "
                                     "which Llama2Tokenizer needs; use --tokenizer-type SentencePieceTokenizer for "
                                     "this model")
        self._vocab: Optional[Dict[str, int]] = None

    @property
    def sp_model(self):
        """The underlying sentencepiece.SentencePieceProcessor."""
        return self._sp

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> Dict[str, int]:
        if self._vocab is None:
            self._vocab = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: self._sp.id_to_piece(i) for i in range(self.vocab_size)}

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        """Megatron-LM's defaults are for text completion: BOS first, no EOS."""
        if not isinstance(text, str):
            raise TypeError(f"Llama2Tokenizer.tokenize takes a str, not {type(text).__name__}")
        ids = self._sp.encode(text)
        return ([self._bos_id] if bos else []) + ids + ([self._eos_id] if eos else [])

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if not texts:
            return []
        return [[self._bos_id, *ids] for ids in self._sp.encode(list(texts), out_type=int, num_threads=1)]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._sp.decode_ids([int(i) for i in token_ids])

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
    def pad(self) -> int:
        if self._pad_id < 0:
            return self._missing("PAD")
        return self._pad_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def eod(self) -> int:
        return self._eos_id

    @property
    def additional_special_tokens_ids(self) -> Optional[List[int]]:
        return None
