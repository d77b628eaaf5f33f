"""Offline Punkt sentence splitting for `tools/preprocess_data.py --split-sentences` (never downloads anything).

Model choice for `--lang L`: NLTK's own Punkt model for L when its punkt_tab data is installed locally (read as
nltk >= 3.8.2 reads it; the old pickled ``punkt`` models are never unpickled: a pickle can run code); otherwise, for English only, the Punkt parameters bundled in this repository
(`megatron/data/punkt_english.json`, learned with NLTK's PunktTrainer from the OpenWebText-1000 and LAMBADA texts).
`--keep-newlines` keeps the whitespace (newlines) that follows a sentence end, as Megatron's CustomLanguageVars does.

The splitting itself runs megatron.data.punkt_fast (NLTK's Punkt algorithm restructured, same sentences, ~5x faster);
nltk is imported only to read installed NLTK data (its import costs ~1.3 s CPU), and `engine="nltk"` runs NLTK's
own PunktSentenceTokenizer (the reference the tests compare against).
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

from megatron import optional
from megatron.data.punkt_fast import FastPunkt

BUNDLED_PARAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "punkt_english.json")


def _keep_newlines_vars() -> Any:
    class KeepNewlinesLanguageVars(optional.nltk("tokenize.punkt").PunktLanguageVars):
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


def _nltk_data_dirs() -> List[str]:
    """Where nltk.data looks for data (NLTK_DATA, the home folder, the Python prefix, the system folders)."""
    dirs = [d for d in os.environ.get("NLTK_DATA", "").split(os.pathsep) if d]
    home = os.path.expanduser("~/")
    if home != "~/":
        dirs.append(os.path.join(home, "nltk_data"))
    for sub in ("nltk_data", os.path.join("share", "nltk_data"), os.path.join("lib", "nltk_data")):
        dirs.append(os.path.join(sys.prefix, sub))
    if os.name == "nt":  # pragma: no cover
        dirs += [os.path.join(os.environ.get("APPDATA", "C:\\"), "nltk_data"), r"C:\nltk_data", r"D:\nltk_data",
                 r"E:\nltk_data"]
    else:
        dirs += ["/usr/share/nltk_data", "/usr/local/share/nltk_data", "/usr/lib/nltk_data", "/usr/local/lib/nltk_data"]
    return dirs


def _nltk_punkt_data_present() -> bool:
    """Whether NLTK's punkt_tab data (plain or zipped) is installed, without importing nltk."""
    for d in _nltk_data_dirs():
        for name in ("punkt_tab", "punkt_tab.zip"):
            if os.path.exists(os.path.join(d, "tokenizers", name)):
                return True
    return False


def _installed_params(lang: str) -> Optional[Any]:
    """Punkt parameters from locally installed NLTK data, or None."""
    if not _nltk_punkt_data_present():
        return None
    try:  # punkt_tab (plain text); the pickled punkt models are never loaded: nltk < 3.8.2 unpickles them fully
        return optional.nltk("tokenize.punkt").PunktTokenizer(lang)._params
    except (LookupError, OSError, ValueError, ImportError):
        return None


def _bundled_params() -> Any:
    """The bundled English parameters with PunktParameters' attributes (no nltk needed)."""
    with open(BUNDLED_PARAMS, encoding="utf-8") as f:
        raw = json.load(f)
    ortho: Dict[str, int] = defaultdict(int)
    ortho.update(raw["ortho_context"])
    return SimpleNamespace(abbrev_types=set(raw["abbrev_types"]), collocations={tuple(c) for c in raw["collocations"]},
                           sent_starters=set(raw["sent_starters"]), ortho_context=ortho)


def _nltk_params(params: Any) -> Any:
    punkt = optional.nltk("tokenize.punkt")
    if isinstance(params, punkt.PunktParameters):
        return params
    out = punkt.PunktParameters()
    out.abbrev_types, out.collocations = set(params.abbrev_types), set(params.collocations)
    out.sent_starters = set(params.sent_starters)
    out.ortho_context.update(params.ortho_context)
    return out


def describe_model(lang: str) -> str:
    if _installed_params(lang) is not None:
        return f"NLTK Punkt model '{lang}' (installed NLTK data)"
    return f"bundled Punkt parameters {os.path.relpath(BUNDLED_PARAMS)}"


class SentenceSplitter:
    """Callable text -> list of sentences. engine "fast" (default) or "nltk" (NLTK's own tokenizer; needs nltk)."""

    def __init__(self, lang: str = "english", keep_newlines: bool = False, engine: str = "fast"):
        if engine not in ("fast", "nltk"):
            raise ValueError(f"sentence splitter engine must be 'fast' or 'nltk', got {engine!r}")
        params = _installed_params(lang)
        if params is None:
            if lang != "english":
                raise RuntimeError(f"--lang {lang}: no NLTK Punkt data for it is installed and only English "
                                   "parameters are bundled; install NLTK's punkt_tab data locally (NLTK_DATA)")
            params = _bundled_params()
        self.engine = engine
        if engine == "fast":
            self._split = FastPunkt.from_params(params, keep_newlines)
            return
        try:
            punkt = optional.nltk("tokenize.punkt")
        except ImportError:
            raise RuntimeError("the nltk sentence splitter engine needs nltk: pip install nltk") from None
        lang_vars = _keep_newlines_vars() if keep_newlines else None
        self._split = punkt.PunktSentenceTokenizer(_nltk_params(params), lang_vars=lang_vars).tokenize

    def __call__(self, text: str) -> List[str]:
        return self._split(text)
