"""WikiText / PTB / LAMBADA detokenizer rules (Megatron's zeroshot_gpt detokenizer)."""
from __future__ import annotations

import pytest

from tasks.zeroshot_gpt.detokenizer import (
    get_detokenizer,
    lambada_detokenizer,
    ptb_detokenizer,
    wikitext_detokenizer,
)


@pytest.mark.parametrize("raw, expected", [
    ("the 1 @,@ 000 @-@ year @-@ old rule", "the 1,000-year-old rule"),
    ("it weighs 3 @.@ 5 kg", "it weighs 3.5 kg"),
    ("first , second ; third : fourth . fifth ! sixth ? end", "first, second; third: fourth. fifth! sixth? end"),
    ("a ( bracketed phrase ) and [ square one ] and { curly }", "a (bracketed phrase) and [square one] and {curly}"),
    ('he said " hello there " loudly', 'he said "hello there" loudly'),
    ("x \n = = = Gameplay = = = \n", "x\n=== Gameplay ===\n"),
    ("x \n = = Reception = = \n", "x\n== Reception ==\n"),
    ("x \n = = = = Deep = = = = \n", "x\n==== Deep ====\n"),
    ("the player 's team", "the player's team"),
    ("the players ' team", "the players' team"),
    ("at 20 ° C", "at 20°C"),
    ("line one \n line two", "line one\nline two"),
])
def test_wikitext_detokenizer(raw, expected):
    assert wikitext_detokenizer(raw) == expected


def test_wikitext_detokenizer_on_a_real_paragraph(shared_data):
    text = (shared_data / "wikitext-103" / "wiki.test.tokens").read_text(encoding="utf-8")[:20000]
    out = wikitext_detokenizer(text)
    assert "@-@" not in out and "@,@" not in out and "@.@" not in out
    assert " , " not in out and " . " not in out
    assert "Robert Boulter" in out


def test_ptb_and_lambada_detokenizers():
    # Megatron's PTB rules: " N " -> "1 " (the number placeholder), "$ 1" -> "$1", " '" and " n't" attach
    assert ptb_detokenizer("it is n't N years 's") == "it isn't1 years's"
    assert ptb_detokenizer("costs $ N dollars") == "costs $1 dollars"
    assert lambada_detokenizer("  \u201chi\u201d she said \n") == '\n"hi" she said'


def test_get_detokenizer_picks_by_file_name():
    assert get_detokenizer("/data/wikitext-103/wiki.test.tokens") is wikitext_detokenizer
    assert get_detokenizer("/tmp/test_lambada0/wiki.test.tokens") is wikitext_detokenizer
    assert get_detokenizer("ptb.test.txt") is ptb_detokenizer
    assert get_detokenizer("lambada_test.jsonl") is lambada_detokenizer
    assert get_detokenizer("other.txt")("a , b") == "a , b"
