"""The fast Punkt splitter (megatron/data/punkt_fast.py) gives NLTK's PunktSentenceTokenizer sentences exactly.

Compared on the whole OpenWebText-1000 sample, the WikiText-2/103 files (all of them with the full data set) and random strings made of
Punkt's tricky characters, with the bundled English parameters, for the default and `--keep-newlines` variants.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.data.sentence_splitter import SentenceSplitter

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("nltk")  # the reference


def _corpus(data: Path) -> list:
    owt = data / "openwebtext-1000" / "openwebtext-1000.jsonl"
    texts = [json.loads(line)["text"] for line in owt.read_text(encoding="utf-8").splitlines()]
    for path in sorted(data.glob("wikitext-*/wiki.*.tokens")):
        lines = path.read_text(encoding="utf-8").split("\n")
        texts += ["\n".join(lines[i:i + 200]) for i in range(0, len(lines), 200)]  # article-sized pieces
    return texts


def _random_texts(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    words = ["Mr.", "mr.", "U.S.", "Dr", "e.g.", "J.", "j.", "No.", "1990.", "3.5", "-2,000.", "...", "..", ". . .",
             "end.", "End.", "The", "the", "However", "he", "said", "(", ")", '"', "'", "\u201c", "\u201d", "\xbb",
             "?", "!", "!!", "?!", ".", ",", ";", ":", "--", "-", "a-b.", "co.", "Inc.", "St.", "A.", "x.y.", "i.e.",
             "\u00c9cole.", "\u0130stanbul", "na\u0308ive.", "\u0661\u0662.", "[1].", "}", "*", "@", "&", "#"]
    seps = [" ", " ", " ", "  ", "\n", "\n\n", "\t", "\x0b", "\x0c", "\r\n", "\xa0", "\u2028", "", "\x1c"]
    return ["".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("keep_newlines", [False, True], ids=["default", "keep-newlines"])
def test_fast_punkt_equals_nltk(wide_data, keep_newlines):
    fast = SentenceSplitter("english", keep_newlines, engine="fast")
    ref = SentenceSplitter("english", keep_newlines, engine="nltk")
    corpus = _corpus(wide_data)
    texts = corpus + _random_texts(2000, seed=int(keep_newlines))
    mismatches = [i for i, text in enumerate(texts) if fast(text) != ref(text)]
    assert mismatches == []
    assert sum(len(fast(t)) for t in corpus) > 10 * len(corpus)  # really split (OpenWebText: ~38 per document)


def test_fast_splitter_does_not_import_nltk():
    text = "Mr. Smith left at 5 p.m. and came back. Really?! (Yes.) \u201cNo.\u201d The end..."
    code = ("import sys; from megatron.data.sentence_splitter import SentenceSplitter; "
            f"print(SentenceSplitter()({text!r})); print('nltk' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    sentences, imported = out.strip().split("\n")
    expected = SentenceSplitter(engine="nltk")(text)
    assert sentences == repr(expected) and len(expected) >= 4
    assert imported == "False"


def test_fast_punkt_with_tiny_caches(shared_data, monkeypatch):
    """The context and token caches restart when full; the sentences stay NLTK's."""
    from megatron.data.punkt_fast import FastPunkt

    monkeypatch.setattr(FastPunkt, "MAX_CACHE", 16)
    fast = SentenceSplitter("english", engine="fast")
    ref = SentenceSplitter("english", engine="nltk")
    texts = _corpus(shared_data)[:150]
    assert [fast(t) for t in texts] == [ref(t) for t in texts]
    assert len(fast._split._decisions) <= 16 and len(fast._split._tokens) <= 16
