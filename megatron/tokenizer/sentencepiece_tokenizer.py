"""SentencePiece (`--tokenizer-type SentencePieceTokenizer`, `--tokenizer-model`), Megatron semantics.

Ids of ordinary text are exactly `sentencepiece`'s `encode_as_ids`. As Megatron does, the special tokens <CLS>, <SEP>,
<EOD>, <MASK>, the model's pad/bos/eos pieces (or <PAD>/<BOS>/<EOS> when the model has none) and the T5 sentinels
<extra_id_N> are appended to the vocab when missing; text is split at literal occurrences of these special tokens
(leftmost match first), which map to their ids, and the pieces between them are encoded by sentencepiece.
"""
from __future__ import annotations

import re
from typing import Dict, List, Sequence

from megatron.errors import InputFileError, InputFileNotFoundError
from megatron.tokenizer.abstract import AbstractTokenizer


class SentencePieceTokenizer(AbstractTokenizer):
    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__("SentencePieceTokenizer")
        import sentencepiece

        if not model_file:
            raise InputFileError("SentencePieceTokenizer needs --tokenizer-model (a sentencepiece .model file)")
        try:
            with open(model_file, "rb") as f:
                proto = f.read()
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        except FileNotFoundError:
            raise InputFileNotFoundError(f"--tokenizer-model {model_file}: file not found") from None
        except RuntimeError as exc:
            raise InputFileError(f"--tokenizer-model {model_file}: not a sentencepiece model ({exc})") from None
        sp = self._sp
        self._vocab: Dict[str, int] = {}
        self._inv_vocab: Dict[int, str] = {}
        for i in range(len(sp)):
            piece = sp.id_to_piece(i)
            self._vocab[piece] = i
            self._inv_vocab[i] = piece
        self._special: Dict[str, int] = {}
        self._inv_special: Dict[int, str] = {}
        self._cls_id = self._add_special("<CLS>")
        self._sep_id = self._add_special("<SEP>")
        self._eod_id = self._add_special("<EOD>")
        self._mask_id = self._add_special("<MASK>")
        self._pad_id = self._add_special(self._model_piece(sp.pad_id(), "<PAD>"))
        self._bos_id = self._add_special(self._model_piece(sp.bos_id(), "<BOS>"))
        self._eos_id = self._add_special(self._model_piece(sp.eos_id(), "<EOS>"))
        self._t5_tokens = [f"<extra_id_{i}>" for i in range(int(vocab_extra_ids or 0))]
        for t in self._t5_tokens:
            self._add_special(t)
        # Python's regex alternation takes the first alternative matching at the leftmost position, the same
        # tie-break as scanning the specials in insertion order.
        self._special_re = re.compile("|".join(re.escape(t) for t in self._special))

    def _model_piece(self, piece_id: int, default: str) -> str:
        if 0 <= piece_id < len(self._sp):
            return self._sp.id_to_piece(piece_id)
        return default

    def _add_special(self, token: str) -> int:
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
        self._special[token] = self._vocab[token]
        self._inv_special[self._vocab[token]] = token
        return self._vocab[token]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        start = 0
        for m in self._special_re.finditer(text):
            ids.extend(self._sp.encode_as_ids(text[start:m.start()]))
            ids.append(self._special[m.group()])
            start = m.end()
        ids.extend(self._sp.encode_as_ids(text[start:]))
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        plain = [i for i, t in enumerate(texts) if not self._special_re.search(t)]
        out: List[List[int]] = [None] * len(texts)  # type: ignore[list-item]
        if plain:
            for i, ids in zip(plain, self._sp.encode([texts[i] for i in plain], out_type=int, num_threads=1)):
                out[i] = ids
        for i, ids in enumerate(out):
            if ids is None:
                out[i] = self.tokenize(texts[i])
        return out

    def detokenize(self, token_ids: Sequence[int]) -> str:
        ids = [int(i) for i in token_ids]
        text, last = "", 0
        for i, tid in enumerate(ids):
            if tid in self._inv_special:
                text += self._sp.decode_ids(ids[last:i]) + " " + self._inv_special[tid] + " "
                last = i + 1
        return text + self._sp.decode_ids(ids[last:])

    @property
    def cls(self) -> int:
        return self._cls_id

    @property
    def sep(self) -> int:
        return self._sep_id

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def mask(self) -> int:
        return self._mask_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return [self._vocab[t] for t in self._t5_tokens]
