"""BERT WordPiece (`BertWordPieceLowerCase` / `BertWordPieceCase`, `--vocab-file` with one token per line).

Ids equal Hugging Face's BertTokenizerFast on the same vocab (BERT normalizer, BERT pre-tokenizer, WordPiece with
max 100 chars per word), computed by the `tokenizers` engine. As in Megatron, "[BOS]" and "[EOS]" and the T5
sentinels "<extra_id_N>" (`vocab_extra_ids`) are appended to the vocab when missing, and they count in vocab_size;
literal special strings such as "[CLS]" in the text are ordinary text (Megatron's FullTokenizer splits them).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from megatron.tokenizer.abstract import AbstractTokenizer


def load_wordpiece_vocab(vocab_file: str) -> Dict[str, int]:
    if not vocab_file:
        raise ValueError("BERT tokenizers need --vocab-file (one WordPiece token per line)")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            tokens = [line.strip() for line in f.read().split("\n")]
    except FileNotFoundError:
        raise FileNotFoundError(f"--vocab-file {vocab_file}: file not found") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--vocab-file {vocab_file}: not a UTF-8 WordPiece vocab ({exc})") from None
    if tokens and tokens[-1] == "":
        tokens.pop()
    vocab = {tok: i for i, tok in enumerate(tokens)}
    for required in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"):
        if required not in vocab:
            raise ValueError(f"--vocab-file {vocab_file}: missing {required}; is this a BERT WordPiece vocab?")
    return vocab


class BertWordPieceTokenizer(AbstractTokenizer):
    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0):
        super().__init__("BERT Lower Case" if lower_case else "BERT Upper Case")
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

        base = load_wordpiece_vocab(vocab_file)
        tok = Tokenizer(models.WordPiece(vocab=dict(base), unk_token="[UNK]", max_input_chars_per_word=100))
        tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                    lowercase=lower_case)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tok = tok
        self._vocab = base
        self._inv_vocab = {i: t for t, i in base.items()}
        self.cls_id, self.sep_id = base["[CLS]"], base["[SEP]"]
        self.pad_id, self.mask_id = base["[PAD]"], base["[MASK]"]
        self._bos_id = self._add_token("[BOS]")
        self._eos_id = self._add_token("[EOS]")
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(int(vocab_extra_ids or 0))]
        for t in self.additional_special_tokens:
            self._add_token(t)

    def _add_token(self, token: str) -> int:
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
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
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> List[str]:
        return [self._inv_vocab[int(i)] for i in token_ids]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Megatron's convert_tokens_to_string: join with spaces and glue '##' continuations."""
        return " ".join(self.convert_ids_to_tokens(token_ids)).replace(" ##", "").strip()

    decode = detokenize

    def decode_token_ids(self, token_ids: Sequence[int]) -> str:
        """Megatron's variant used in evaluation: drops [PAD]/[CLS] and glues '##' pieces."""
        out = ""
        for t in self.convert_ids_to_tokens(token_ids):
            if t in ("[PAD]", "[CLS]"):
                continue
            out += t[2:] if t.startswith("##") else " " + t
        return out

    @property
    def cls(self) -> int:
        return self.cls_id

    @property
    def sep(self) -> int:
        return self.sep_id

    @property
    def pad(self) -> int:
        return self.pad_id

    @property
    def mask(self) -> int:
        return self.mask_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def bos_token_id(self) -> int:
        return self._bos_id

    @property
    def eos_token_id(self) -> int:
        return self._eos_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return [self._vocab[t] for t in self.additional_special_tokens]
