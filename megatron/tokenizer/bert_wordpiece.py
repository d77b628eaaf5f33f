"""BERT WordPiece (`BertWordPieceLowerCase` / `BertWordPieceCase`, `--vocab-file` with one token per line).

Ids equal Hugging Face's BertTokenizerFast on the same vocab (BERT normalizer, BERT pre-tokenizer, WordPiece with
max 100 chars per word), computed by the `tokenizers` engine. As in Megatron, "[BOS]" and "[EOS]" and the T5
sentinels "<extra_id_N>" (`vocab_extra_ids`) are appended to the vocab when missing, and they count in vocab_size;
literal special strings such as "[CLS]" in the text are ordinary text (Megatron's FullTokenizer splits them).

tokenize_batch has a fast path with the same ids: a text made only of ASCII and a few punctuation/space characters that
BERT's normalizer leaves alone (curly quotes, dashes, the ellipsis, no-break space) is normalized and split into words
with one regular expression (the BERT normalizer and pre-tokenizer reduce to: drop control characters, lowercase,
split on whitespace, isolate punctuation), and each distinct word's WordPiece ids come from a cache filled by the
engine in one batch. Every other text goes through the `tokenizers` engine. tests/tokenizer/test_bert_fast_path.py
compares both on OpenWebText, WikiText and random strings.
"""
from __future__ import annotations

import re
from itertools import chain
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import numpy as np

from megatron.errors import InputFileError, InputFileNotFoundError
from megatron.tokenizer.abstract import AbstractTokenizer

# Characters besides ASCII that BERT's normalizer keeps as they are (no accent, no case, no decomposition) and its
# pre-tokenizer treats as punctuation (isolated) or whitespace (no-break space): common in web text.
_SIMPLE_PUNCT = "\u2018\u2019\u201c\u201d\u2013\u2014\u2026"
_NOT_SIMPLE = re.compile(f"[^\\x00-\\x7f{_SIMPLE_PUNCT}\\xa0]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # removed by the normalizer (tab, CR, LF are spaces)
_PUNCT = f"[!-/:-@\\[-`{{-~{_SIMPLE_PUNCT}]"
_SEP = "\x00"  # joins fast-path texts (a control character: never left inside one) and is a word of its own
_WORDS_LOWER = re.compile(f"[a-z0-9]+|{_PUNCT}|\\x00").findall
_WORDS_CASED = re.compile(f"[A-Za-z0-9]+|{_PUNCT}|\\x00").findall
MAX_WORD_CACHE = 1 << 19  # distinct words kept (~80 MB at most); the table restarts when full


class _WordTable:
    """Distinct normalized words -> row; each row's WordPiece ids in one array (row 0: the separator, no ids)."""

    def __init__(self) -> None:
        self.index: Dict[str, int] = {_SEP: 0}
        self.lens = np.zeros(1, dtype=np.int64)
        self.starts = np.zeros(1, dtype=np.int64)
        self.ids = np.zeros(0, dtype=np.int64)

    def add(self, words: Iterable[str], model: Any) -> None:
        new_lens: List[int] = []
        new_ids: List[int] = []
        for word in words:
            self.index[word] = len(self.index)
            pieces = [t.id for t in model.tokenize(word)]
            new_lens.append(len(pieces))
            new_ids.extend(pieces)
        lens = np.asarray(new_lens, dtype=np.int64)
        self.starts = np.concatenate([self.starts, self.ids.size + np.cumsum(lens) - lens])
        self.lens = np.concatenate([self.lens, lens])
        self.ids = np.concatenate([self.ids, np.asarray(new_ids, dtype=np.int64)])


def load_wordpiece_vocab(vocab_file: str) -> Dict[str, int]:
    if not vocab_file:
        raise InputFileError("BERT tokenizers need --vocab-file (one WordPiece token per line)")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            tokens = [line.strip() for line in f.read().split("\n")]
    except FileNotFoundError:
        raise InputFileNotFoundError(f"--vocab-file {vocab_file}: file not found") from None
    except UnicodeDecodeError as exc:
        raise InputFileError(f"--vocab-file {vocab_file}: not a UTF-8 WordPiece vocab ({exc})") from None
    if tokens and tokens[-1] == "":
        tokens.pop()
    vocab = {tok: i for i, tok in enumerate(tokens)}
    missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]") if t not in vocab]
    if missing:
        raise InputFileError(f"--vocab-file {vocab_file}: missing {', '.join(missing)}; is this a BERT WordPiece "
                             "vocab?")
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
        self._lower = lower_case
        self._words = _WORDS_LOWER if lower_case else _WORDS_CASED
        self._table = _WordTable()

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
        ids, lengths = self.tokenize_flat(texts)
        flat = ids.tolist()
        out, pos = [], 0
        for n in lengths.tolist():
            out.append(flat[pos:pos + n])
            pos += n
        return out

    def tokenize_flat(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        """All texts' ids concatenated (int64) and the number of ids of each text: tokenize_batch without lists."""
        slow_idx: List[int] = []
        fast_idx: List[int] = []
        fast: List[str] = []
        not_simple, control, remove = _NOT_SIMPLE.search, _CONTROL.search, _CONTROL.sub
        for i, text in enumerate(texts):
            if not text.isascii() and not_simple(text):
                slow_idx.append(i)
                continue
            fast_idx.append(i)
            fast.append(remove("", text) if control(text) else text)  # (this also drops any NUL: the separator)
        parts = []
        if fast_idx:
            parts.append((fast_idx, *self._fast_ids(fast)))
        if slow_idx:
            encs = self._tok.encode_batch_fast([texts[i] for i in slow_idx], add_special_tokens=False)
            per_text = [e.ids for e in encs]
            lens = np.fromiter(map(len, per_text), dtype=np.int64, count=len(per_text))
            flat = np.fromiter(chain.from_iterable(per_text), dtype=np.int64, count=int(lens.sum()))
            parts.append((slow_idx, flat, lens))
        lengths = np.zeros(len(texts), dtype=np.int64)
        if not parts:
            return np.zeros(0, dtype=np.int64), lengths
        if len(parts) == 1 and len(parts[0][0]) == len(texts):
            return parts[0][1], parts[0][2]
        for idx, _, lens in parts:
            lengths[idx] = lens
        offsets = np.cumsum(lengths) - lengths
        out = np.empty(int(lengths.sum()), dtype=np.int64)
        for idx, flat, lens in parts:  # scatter each part's texts to their places in input order
            src_start = np.cumsum(lens) - lens
            out[np.repeat(offsets[idx] - src_start, lens) + np.arange(flat.size)] = flat
        return out, lengths

    def _fast_ids(self, texts: List[str]) -> Tuple[np.ndarray, np.ndarray]:
        """Ids of fast-path texts (no control characters left): the texts are joined with NUL separators, split into
        normalized words by one regex, each word becomes its row in the word table (new words go through the
        WordPiece model, which is what the engine runs on each pre-tokenized word) and numpy gathers the ids."""
        joined = _SEP.join(texts)
        words = self._words(joined.lower() if self._lower else joined)
        table = self._table
        missing = set(words).difference(table.index)
        if missing:
            if len(table.index) + len(missing) > MAX_WORD_CACHE:
                table = self._table = _WordTable()
                missing = set(words).difference(table.index)
            table.add(missing, self._tok.model)
        rows = np.fromiter(map(table.index.__getitem__, words), dtype=np.int64, count=len(words))
        lens = table.lens[rows]
        cum = np.zeros(len(words) + 1, dtype=np.int64)
        np.cumsum(lens, out=cum[1:])
        flat = table.ids[np.repeat(table.starts[rows] - cum[:-1], lens) + np.arange(int(cum[-1]))]
        ends = cum[np.append(np.flatnonzero(rows == 0), len(words))]  # ids before each text's separator or the end
        return flat, np.diff(ends, prepend=0)

    def tokenize_batch_reference(self, texts: Sequence[str]) -> List[List[int]]:
        """The `tokenizers` engine on every text (what tokenize_batch's fast path is compared against)."""
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
