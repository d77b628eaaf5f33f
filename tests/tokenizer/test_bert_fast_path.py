"""BertWordPieceTokenizer.tokenize_batch's fast path (regex words + per-word id cache) gives the `tokenizers` engine's
ids: on every OpenWebText sentence and WikiText line, and on random strings mixing ASCII letters, digits, punctuation,
control characters, words over 100 characters, the few non-ASCII characters it handles and others it must leave to
the engine; lower-cased and cased vocabularies; with the word cache overflowing."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megatron.data.sentence_splitter import SentenceSplitter
from megatron.tokenizer import bert_wordpiece
from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer


def _texts(data: Path) -> list:
    owt = (data / "openwebtext-1000" / "openwebtext-1000.jsonl").read_text(encoding="utf-8").splitlines()
    split = SentenceSplitter()
    texts = [s for line in owt[:300] for s in split(json.loads(line)["text"])]
    for path in sorted(data.glob("wikitext-*/wiki.*.tokens"))[:1]:
        texts += path.read_text(encoding="utf-8").split("\n")[:3000]
    rng = random.Random(0)
    pieces = ["The", "the", "DON'T", "co-op", "3.14", "naïve", "Ünïcode", "中文", "straße", "x" * 101, "a" * 100,
              "\u2018", "\u2019", "\u201c", "\u201d", "\u2013", "\u2014", "\u2026", "\xa0", "\u00e9", "\u0301", "\x00",
              "\x01", "\x0b", "\x0c", "\x1f", "\x7f", "\t", "\r", "\n", "\ufffd", "\u200b", "\u2028", "#", "@@", "[CLS]",
              "##ing", "~", "`", "\\", "^_^", "Σ", "ǅ", "\uff01", "😀"]
    seps = [" ", "", "  ", "\n", "\x0b"]
    simple = [p for p in pieces if p.isascii() or not bert_wordpiece._NOT_SIMPLE.search(p)]
    for choices in (pieces, simple):  # mixed (mostly the engine's) and fast-path-only strings
        texts += ["".join(rng.choice(choices) + rng.choice(seps) for _ in range(rng.randint(0, 30)))
                  for _ in range(2000)]
    return texts


@pytest.mark.parametrize("vocab,lower", [("bert-base-uncased-vocab.txt", True), ("bert-base-cased-vocab.txt", False)],
                         ids=["lower", "cased"])
def test_fast_path_equals_engine(shared_data, vocab, lower, monkeypatch):
    tok = BertWordPieceTokenizer(str(shared_data / "bert-wordpiece" / vocab), lower_case=lower)
    texts = _texts(shared_data)
    ref = tok.tokenize_batch_reference(texts)
    assert tok.tokenize_batch(texts) == ref
    assert tok.tokenize_batch(texts[::-1]) == ref[::-1]  # warm cache
    fast = sum(1 for t in texts if t.isascii() or not bert_wordpiece._NOT_SIMPLE.search(t))
    assert fast > 0.6 * len(texts) and fast < len(texts)  # both paths really ran
    monkeypatch.setattr(bert_wordpiece, "MAX_WORD_CACHE", 50)  # the cache is cleared and refilled batch by batch
    small = BertWordPieceTokenizer(str(shared_data / "bert-wordpiece" / vocab), lower_case=lower)
    assert [ids for i in range(0, 2000, 100) for ids in small.tokenize_batch(texts[i:i + 100])] == ref[:2000]
    assert len(small._table.index) <= 50 + 100 * 40
