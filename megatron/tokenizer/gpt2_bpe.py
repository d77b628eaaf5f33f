"""GPT-2 byte-level BPE (`--tokenizer-type GPT2BPETokenizer`, files `--vocab-file` encoder.json + `--merge-file` vocab.bpe).

Ids are exactly those of GPT-2's encoder / Hugging Face's GPT2TokenizerFast built from the same two files. Three
engines compute them:

* ``tiktoken`` (default when usable): a tiktoken Encoding built offline from the files, its mergeable ranks being the
  vocab ids; fastest. It equals standard BPE when (1) the 256 byte symbols exist and the merge results have distinct
  ids increasing in merge order, and (2) every merge result T encodes to [T] under standard BPE (then no adjacent
  pair whose concatenation is a token can appear other than through its own merge). (1) is checked always; (2) is
  checked with `tokenizers` at load time (~5 us per token) unless the files are OpenAI's GPT-2 files (or the
  shared 5,000-token prefix of them), which are known to pass.
* ``hf``: the Hugging Face `tokenizers` BPE model (used for any other vocab layout).
* ``python``: a small pure-Python reference implementation of the BPE algorithm (tests only; slow).

Set ``MEGATRON_BPE_ENGINE=hf|tiktoken|python`` to force one. As in Megatron's GPT-2 tokenizer, the literal text
"<|endoftext|>" is ordinary text (it tokenizes to "<", "|", "endoftext", "|", ">"), never the eod id; only
`tokenizer.eod` (encoder["<|endoftext|>"]) is the end-of-document token. (HF's GPT2TokenizerFast registers
"<|endoftext|>" as a special token and maps the literal string to 50256; we deliberately do not.)
"""
from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.errors import InputFileError, InputFileNotFoundError
from megatron.tokenizer.abstract import AbstractTokenizer

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same pre-tokenization with possessive quantifiers and the trailing-whitespace cases spelled out (the form
# tiktoken's r50k encoding uses): identical pieces, ~25% faster in tiktoken's regex engine.
GPT2_PATTERN_FAST = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOD_TOKEN = "<|endoftext|>"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_latin1_table() -> Dict[int, int]:
    return {ord(ch): b for b, ch in bytes_to_unicode().items()}


def token_to_bytes(token: str) -> bytes:
    """Map a vocab token (byte-level unicode string) to its raw bytes."""
    try:
        return token.translate(_unicode_to_latin1_table()).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the byte alphabet: an added token; use its UTF-8 text
        return token.encode("utf-8")


def load_vocab(vocab_file: str) -> Dict[str, int]:
    if not vocab_file:
        raise InputFileError("GPT2BPETokenizer needs --vocab-file (GPT-2 encoder.json / gpt2-vocab.json)")
    try:
        with open(vocab_file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise InputFileNotFoundError(f"--vocab-file {vocab_file}: file not found") from None
    try:
        try:
            import orjson

            vocab = orjson.loads(raw)
        except ImportError:  # pragma: no cover
            vocab = json.loads(raw)
    except ValueError as exc:
        raise InputFileError(f"--vocab-file {vocab_file}: not a GPT-2 JSON vocab ({exc})") from None
    if not isinstance(vocab, dict) or set(map(type, vocab.values())) - {int}:
        raise InputFileError(f"--vocab-file {vocab_file}: expected a JSON object token -> id (GPT-2 encoder.json)")
    return vocab


def _merge_lines(merge_file: str) -> List[str]:
    if not merge_file:
        raise InputFileError("GPT2BPETokenizer needs --merge-file (GPT-2 vocab.bpe / gpt2-merges.txt)")
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        raise InputFileNotFoundError(f"--merge-file {merge_file}: file not found") from None
    except UnicodeDecodeError as exc:
        raise InputFileError(f"--merge-file {merge_file}: not UTF-8 ({exc})") from None
    if lines and lines[0].startswith("#version"):
        lines[0] = ""
    return lines


def load_merges(merge_file: str) -> List[Tuple[str, str]]:
    merges = []
    for lineno, line in enumerate(_merge_lines(merge_file), 1):
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise InputFileError(f"--merge-file {merge_file}:{lineno}: expected two space-separated symbols, "
                                 f"got {line[:60]!r}")
        merges.append((parts[0], parts[1]))
    return merges


# sha256 of (vocab file, merges file) pairs known to satisfy condition (2) above (checked once, offline).
_KNOWN_CONSISTENT = {
    ("196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",  # OpenAI GPT-2 encoder.json
     "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),  # OpenAI GPT-2 vocab.bpe
    ("4aab6672fb41d467a495d49f763d5f97f7e0091645ace0b02f715acb6b3b6b62",  # gpt2-tiny-vocab.json (5,000 tokens)
     "6797e3789c9467dcc981dd82ca4e671a0da7da72f3bf060a803f04cb89323170"),  # gpt2-tiny-merges.txt
}


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _merges_self_consistent(vocab: Dict[str, int], vocab_file: str, merge_file: str) -> bool:
    """Condition (2): standard BPE turns every merge result T (as a whole word) into the single token T."""
    if (_sha256(vocab_file), _sha256(merge_file)) in _KNOWN_CONSISTENT:
        return True
    from tokenizers import models

    merges = load_merges(merge_file)
    bpe = models.BPE(vocab=dict(vocab), merges=merges)
    for a, b in merges:
        token = a + b
        pieces = bpe.tokenize(token)
        if len(pieces) != 1 or pieces[0].id != vocab[token]:
            return False
    return True


def _vocab_bytes(tokens: List[str]) -> List[bytes]:
    """token_to_bytes for many tokens at once (one translate/encode, then slicing)."""
    try:
        blob = "".join(tokens).translate(_unicode_to_latin1_table()).encode("latin-1")
    except UnicodeEncodeError:
        return [token_to_bytes(t) for t in tokens]
    out, pos = [], 0
    for t in tokens:
        out.append(blob[pos:pos + len(t)])
        pos += len(t)
    return out


def _tiktoken_ranks(vocab: Dict[str, int], merge_file: str) -> Optional[Dict[bytes, int]]:
    """Vocab ids as tiktoken ranks, or None when they cannot reproduce BPE merge priority.

    Valid when every vocab entry other than eod is a single byte or a merge result, all 256 byte symbols exist,
    and the merge results have distinct ids that increase in merge order (so rank order == merge priority).
    """
    merged = [line.replace(" ", "") for line in _merge_lines(merge_file) if line]
    ids = [vocab.get(m, -1) for m in merged]
    arr = np.asarray(ids, dtype=np.int64)
    if (arr < 0).any() or (np.diff(arr) <= 0).any():
        return None
    byte_ids = [vocab.get(ch) for ch in bytes_to_unicode().values()]
    if None in byte_ids or (ids and max(byte_ids) >= ids[0]):
        return None
    if len(vocab) - (EOD_TOKEN in vocab) != 256 + len(ids):
        return None
    tokens = [t for t in vocab if t != EOD_TOKEN]
    ranks = dict(zip(_vocab_bytes(tokens), [vocab[t] for t in tokens]))
    return ranks if len(ranks) == len(tokens) else None


class _TiktokenEngine:
    name = "tiktoken"

    def __init__(self, ranks: Dict[bytes, int]):
        import tiktoken

        self._enc = tiktoken.Encoding("megatron-gpt2-bpe", pat_str=GPT2_PATTERN_FAST, mergeable_ranks=ranks,
                                      special_tokens={})
        self._encode = self._enc.encode_ordinary

    def encode(self, text: str) -> List[int]:
        return self._encode(text)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        enc = self._encode
        return [enc(t) for t in texts]


class _HFEngine:
    name = "hf"

    def __init__(self, vocab: Dict[str, int], merges: List[Tuple[str, str]]):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]


class _PythonEngine:
    """Reference BPE: regex pre-tokenization, byte->unicode mapping, greedy lowest-rank pair merging."""

    name = "python"

    def __init__(self, vocab: Dict[str, int], merges: List[Tuple[str, str]]):
        import regex

        self._pat = regex.compile(GPT2_PATTERN)
        self._vocab = vocab
        self._merge_rank = {pair: i for i, pair in enumerate(merges)}
        self._cache: Dict[str, List[int]] = {}

    def _bpe(self, word: str) -> List[int]:
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                r = self._merge_rank.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            pair = (parts[best], parts[best + 1])
            merged, i = [], 0
            while i < len(parts):  # merge every occurrence of the best pair, left to right
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return [self._vocab[p] for p in parts]

    def encode(self, text: str) -> List[int]:
        b2u = bytes_to_unicode()
        out: List[int] = []
        for piece in self._pat.findall(text):
            word = "".join(b2u[b] for b in piece.encode("utf-8"))
            ids = self._cache.get(word)
            if ids is None:
                ids = self._cache[word] = self._bpe(word)
            out.extend(ids)
        return out

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.encode(t) for t in texts]


class GPT2BPETokenizer(AbstractTokenizer):
    """Megatron's GPT2BPETokenizer: byte-level BPE, eod = encoder['<|endoftext|>']."""

    def __init__(self, vocab_file: str, merge_file: str, engine: Optional[str] = None):
        super().__init__("GPT2 BPE")
        self._vocab = load_vocab(vocab_file)
        if EOD_TOKEN not in self._vocab:
            raise InputFileError(f"--vocab-file {vocab_file}: has no '{EOD_TOKEN}' entry, which GPT2BPETokenizer "
                                 "uses as eod")
        self.eod_id = self._vocab[EOD_TOKEN]
        engine = engine or os.environ.get("MEGATRON_BPE_ENGINE", "auto")
        if engine not in ("auto", "tiktoken", "hf", "python"):
            raise ValueError(f"MEGATRON_BPE_ENGINE={engine!r}: expected auto, tiktoken, hf or python")
        ranks = _tiktoken_ranks(self._vocab, merge_file) if engine in ("auto", "tiktoken") else None
        if ranks is not None and not _merges_self_consistent(self._vocab, vocab_file, merge_file):
            ranks = None
        if engine == "tiktoken" and ranks is None:
            raise InputFileError(f"--vocab-file {vocab_file}: these BPE files cannot be run exactly by tiktoken "
                             "(ids not in merge order or merges not self-consistent); use MEGATRON_BPE_ENGINE=hf")
        if ranks is not None:
            self.engine = _TiktokenEngine(ranks)
        elif engine == "python":
            self.engine = _PythonEngine(self._vocab, load_merges(merge_file))
        else:
            self.engine = _HFEngine(self._vocab, load_merges(merge_file))
        self._inv_vocab: Optional[Dict[int, str]] = None
        self._id_bytes: Optional[List[bytes]] = None

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {v: k for k, v in self._vocab.items()}
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        return self.engine.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self.engine.encode_batch(texts)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        if self._id_bytes is None:
            table: List[bytes] = [b""] * (max(self._vocab.values()) + 1)
            for tok, i in self._vocab.items():
                table[i] = EOD_TOKEN.encode() if i == self.eod_id else token_to_bytes(tok)
            self._id_bytes = table
        table = self._id_bytes
        ids = [int(i) for i in token_ids]
        bad = [i for i in ids if not 0 <= i < len(table)]
        if bad:
            raise ValueError(f"GPT2BPETokenizer.detokenize: id {bad[0]} is outside the vocabulary [0, {len(table)})")
        return b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")

    @property
    def eod(self) -> int:
        return self.eod_id
