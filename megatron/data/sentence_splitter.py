"""Offline NLTK Punkt sentence splitting for `tools/preprocess_data.py --split-sentences` (never downloads anything).

Model choice for `--lang L`: NLTK's own Punkt model for L when its data (punkt_tab or punkt) is installed locally,
exactly as Megatron loads it; otherwise, for English only, the Punkt parameters bundled in this repository
(`megatron/data/punkt_english.json`, learned with NLTK's PunktTrainer from the OpenWebText-1000 and LAMBADA texts).
`--keep-newlines` keeps the whitespace (newlines) that follows a sentence end, as Megatron's CustomLanguageVars does.
"""
from __future__ import annotations

import json
import os
from typing import Any, List, Optional

BUNDLED_PARAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "punkt_english.json")


def _keep_newlines_vars() -> Any:
    from nltk.tokenize.punkt import PunktLanguageVars

    class KeepNewlinesLanguageVars(PunktLanguageVars):
        # Same as Punkt's period context, except that whitespace after the sentence end belongs to the
        # sentence (\s* instead of \s+, and no whitespace before the next token).
        _period_context_fmt = r"""
            \S*                          # word material before the candidate end
            %(SentEndChars)s             # the potential sentence end
            \s*                          # trailing whitespace (kept with the sentence)
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or the next word
            ))"""

    return KeepNewlinesLanguageVars()


def _installed_params(lang: str) -> Optional[Any]:
    """Punkt parameters from locally installed NLTK data, or None."""
    import nltk

    try:
        from nltk.tokenize.punkt import PunktTokenizer

        return PunktTokenizer(lang)._params
    except (LookupError, OSError, ValueError, ImportError):
        pass
    try:
        return nltk.data.load(f"tokenizers/punkt/{lang}.pickle")._params
    except (LookupError, OSError, ValueError):
        return None


def _bundled_params() -> Any:
    from nltk.tokenize.punkt import PunktParameters

    with open(BUNDLED_PARAMS, encoding="utf-8") as f:
        raw = json.load(f)
    params = PunktParameters()
    params.abbrev_types = set(raw["abbrev_types"])
    params.collocations = {tuple(c) for c in raw["collocations"]}
    params.sent_starters = set(raw["sent_starters"])
    for word, flags in raw["ortho_context"].items():
        params.ortho_context[word] = flags
    return params


def describe_model(lang: str) -> str:
    if _installed_params(lang) is not None:
        return f"NLTK Punkt model '{lang}' (installed NLTK data)"
    return f"bundled Punkt parameters {os.path.relpath(BUNDLED_PARAMS)}"


class SentenceSplitter:
    """Callable text -> list of sentences."""

    def __init__(self, lang: str = "english", keep_newlines: bool = False):
        try:
            from nltk.tokenize.punkt import PunktSentenceTokenizer
        except ImportError:
            raise RuntimeError("--split-sentences needs nltk: pip install nltk") from None
        params = _installed_params(lang)
        if params is None:
            if lang != "english":
                raise RuntimeError(f"--lang {lang}: no NLTK Punkt data for it is installed and only English "
                                   "parameters are bundled; install NLTK's punkt_tab data locally (NLTK_DATA)")
            params = _bundled_params()
        if keep_newlines:
            self._tok = PunktSentenceTokenizer(params, lang_vars=_keep_newlines_vars())
        else:
            self._tok = PunktSentenceTokenizer(params)

    def __call__(self, text: str) -> List[str]:
        return self._tok.tokenize(text)
