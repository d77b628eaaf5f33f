"""Detokenizers for zero-shot evaluation data (the rules of Megatron's tasks/zeroshot_gpt/detokenizer.py).

WikiText-103 is distributed word-tokenized (" @-@ ", " , ", spaces inside brackets); before GPT-2 BPE tokenization
it is turned back into running text. `get_detokenizer(path)` picks the rule set from the file name.
"""
from __future__ import annotations

import os
import re
from typing import Callable


def ptb_detokenizer(string: str) -> str:
    """Penn Treebank: re-attach punctuation, contractions and the ' N ' number placeholder."""
    string = string.replace(" '", "'")
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" n't", "n't")
    string = string.replace(" N ", "1 ")
    string = string.replace("$ 1", "$1")
    string = string.replace("# 1", "#1")
    return string


def wikitext_detokenizer(string: str) -> str:
    """WikiText: undo the @-@ / @,@ / @.@ number separators, punctuation spacing, brackets, quotes and headings."""
    # contractions
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    for mark in (":", ";", ".", "!", "?", ","):
        string = string.replace(f" {mark} ", f"{mark} ")
    # brackets and quotes: drop the spaces just inside them
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # headings and the rest
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string


def lambada_detokenizer(string: str) -> str:
    """LAMBADA: typographic double quotes -> ASCII, stripped, with a leading newline (as Megatron)."""
    string = string.replace("\u201c", '"')
    string = string.replace("\u201d", '"')
    return "\n" + string.strip()


_DETOKENIZERS: dict[str, Callable[[str], str]] = {
    "ptb": ptb_detokenizer,
    "wiki": wikitext_detokenizer,
    "lambada": lambada_detokenizer,
}


def get_detokenizer(path: str) -> Callable[[str], str]:
    """The detokenizer whose key ('ptb', 'wiki', 'lambada') occurs in the file name (else in `path`), or identity."""
    for where in (os.path.basename(path), path):
        for key, fn in _DETOKENIZERS.items():
            if key in where:
                return fn
    return lambda s: s
