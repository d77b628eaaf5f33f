"""A fast Punkt sentence splitter that gives NLTK's `PunktSentenceTokenizer.tokenize` sentences exactly (no nltk import).

Same algorithm and same regular expressions as NLTK 3.9+ (the `regex` engine, as NLTK uses), same parameters
(abbreviation types, collocations, sentence starters, orthographic context), restructured for speed:

- Candidate ends are found with the same period-context expression, and the context handed to the decision is the
  same string NLTK builds (the word before, the candidate, the token after).
- The decision "does this context contain a sentence break" depends only on that string. It is computed from the
  context's word tokens with Punkt's first pass (type-based) and second pass (collocation, orthographic and
  sentence-starter heuristics) on token pairs, with every per-token property computed once per distinct token and
  every decision cached per distinct context. No token objects, no generators.
- Boundary realignment (closing quotes/brackets after the end) is NLTK's rule on the list of spans.

tests/data/test_punkt_fast.py proves the output equal to NLTK's on OpenWebText-1000 and WikiText (when nltk is
installed) for the default and the `--keep-newlines` language variables. The expressions are those of the NLTK release
this repository is tested with (3.10, whose Punkt treats curly quotes and guillemets as closing punctuation); an older
NLTK can split differently around those quotes.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

try:
    import regex as _rx  # the engine NLTK compiles its Punkt expressions with (Unicode classes differ from re's)
except ImportError:  # pragma: no cover - `regex` comes with nltk and transformers
    import re as _rx

# Orthographic-context flags as stored in Punkt parameters.
ORTHO_BEG_UC, ORTHO_MID_UC, ORTHO_UNK_UC = 1 << 1, 1 << 2, 1 << 3
ORTHO_BEG_LC, ORTHO_MID_LC, ORTHO_UNK_LC = 1 << 4, 1 << 5, 1 << 6
ORTHO_UC = ORTHO_BEG_UC | ORTHO_MID_UC | ORTHO_UNK_UC
ORTHO_LC = ORTHO_BEG_LC | ORTHO_MID_LC | ORTHO_UNK_LC

SENT_END_CHARS = (".", "?", "!")
PUNCTUATION = (";", ":", ",", ".", "!", "?")
ASCII_WHITESPACE = " \t\n\r\x0b\x0c"  # Python's string.whitespace: what NLTK looks for before a candidate

_NON_WORD = r"(?:[)\";}\]\*:@\'\({\[\u2018\u2019\u201c\u201d\xab\xbb!\?])"
_MULTI_CHAR = r"(?:\-{2,}|\.{2,}|(?:\.\s){2,}\.)"
_WORD_START = r"[^\(\"\`{\[:;&\#\*@\)}\]\-,]"
_SENT_END = r"[\.\?!]"

WORD_TOKENIZER = rf"""(
    {_MULTI_CHAR}
    |
    (?={_WORD_START})\S+?
    (?=
        \s|
        $|
        {_NON_WORD}|{_MULTI_CHAR}|
        ,(?=$|\s|{_NON_WORD}|{_MULTI_CHAR})
    )
    |
    \S
)"""

# Candidate sentence end; the token after it in a lookahead.
PERIOD_CONTEXT = rf"""
    {_SENT_END}
    (?=(?P<after_tok>
        {_NON_WORD}
        |
        \s+(?P<next_tok>\S+)
    ))"""

# --keep-newlines (Megatron's CustomLanguageVars): the word before is part of the match and the whitespace after the
# end stays with the sentence.
PERIOD_CONTEXT_KEEP_NEWLINES = rf"""
    \S*
    {_SENT_END}
    \s*
    (?=(?P<after_tok>
        {_NON_WORD}
        |
        (?P<next_tok>\S+)
    ))"""

BOUNDARY_REALIGNMENT = r'["\')\]}\u2018\u2019\u201c\u201d\xab\xbb]+?(?:\s+|(?=--)|$)'

# the last ASCII whitespace character in text[pos:endpos] (a reverse search of the `regex` engine)
_LAST_WS = _rx.compile(r"(?r)[ \t\n\r\x0b\x0c]") if _rx.__name__ == "regex" else None
_ELLIPSIS = _rx.compile(r"\.\.+$")
_NUMERIC = _rx.compile(r"^-?[\.,]?\d[\d,\.-]*\.?$")
_INITIAL = _rx.compile(r"[^\W\d]\.$", _rx.UNICODE)

# Per-token record: (period_final, first-pass sentbreak, abbr or ellipsis, type without period,
#                    type without sentence period, is initial, first upper, first lower, is punctuation)
_Tok = Tuple[bool, bool, bool, str, str, bool, bool, bool, bool]


class FastPunkt:
    """Callable text -> list of sentences, equal to NLTK's PunktSentenceTokenizer(params).tokenize(text)."""

    MAX_CACHE = 1 << 18  # entries per cache (contexts, tokens): a few tens of MB at most

    def __init__(self, abbrev_types: Iterable[str], collocations: Iterable[Tuple[str, str]],
                 sent_starters: Iterable[str], ortho_context: Dict[str, int], keep_newlines: bool = False):
        self.abbrev_types = frozenset(abbrev_types)
        self.collocations = frozenset(tuple(c) for c in collocations)
        self.sent_starters = frozenset(sent_starters)
        self.ortho_context = {k: int(v) for k, v in ortho_context.items()}
        flags = _rx.UNICODE | _rx.VERBOSE
        self._period = _rx.compile(PERIOD_CONTEXT_KEEP_NEWLINES if keep_newlines else PERIOD_CONTEXT, flags)
        self._words = _rx.compile(WORD_TOKENIZER, flags).findall
        self._realign = _rx.compile(BOUNDARY_REALIGNMENT, _rx.MULTILINE).match
        self._last_ws = _LAST_WS.search if _LAST_WS is not None else None
        self._tokens: Dict[str, _Tok] = {}
        self._decisions: Dict[str, bool] = {}

    @classmethod
    def from_params(cls, params: Any, keep_newlines: bool = False) -> FastPunkt:
        """From an object with NLTK PunktParameters' attributes."""
        return cls(params.abbrev_types, params.collocations, params.sent_starters, dict(params.ortho_context),
                   keep_newlines)

    # -- per token -----------------------------------------------------------------------------------------------
    def _token(self, tok: str) -> _Tok:
        rec = self._tokens.get(tok)
        if rec is not None:
            return rec
        typ = _NUMERIC.sub("##number##", tok.lower())
        period_final = tok.endswith(".")
        sentbreak = abbr_or_ellipsis = False
        if tok in SENT_END_CHARS:
            sentbreak = True
        elif _ELLIPSIS.match(tok):
            abbr_or_ellipsis = True
        elif period_final and not tok.endswith(".."):
            low = tok[:-1].lower()
            if low in self.abbrev_types or low.split("-")[-1] in self.abbrev_types:
                abbr_or_ellipsis = True
            else:
                sentbreak = True
        type_no_period = typ[:-1] if len(typ) > 1 and typ[-1] == "." else typ
        rec = (period_final, sentbreak, abbr_or_ellipsis, type_no_period, type_no_period if sentbreak else typ,
               _INITIAL.match(tok) is not None, tok[0].isupper(), tok[0].islower(), tok in PUNCTUATION)
        if len(self._tokens) >= self.MAX_CACHE:
            self._tokens.clear()
        self._tokens[tok] = rec
        return rec

    def _ortho(self, t2: _Tok) -> Optional[bool]:
        """Orthographic heuristic for the token after a candidate: True (starts a sentence), False, None (unknown)."""
        if t2[8]:
            return False
        ctx = self.ortho_context.get(t2[4], 0)
        if t2[6] and ctx & ORTHO_LC and not ctx & ORTHO_MID_UC:
            return True
        if t2[7] and (ctx & ORTHO_UC or not ctx & ORTHO_BEG_LC):
            return False
        return None

    def _breaks(self, t1: _Tok, t2: _Tok) -> bool:
        """Punkt's final sentence-break label of token t1 followed by t2 (first pass, then the second pass)."""
        if not t1[0]:
            return t1[1]
        typ, next_typ, initial = t1[3], t2[4], t1[5]
        if (typ, next_typ) in self.collocations:
            return False
        if t1[2] and not initial:
            if self._ortho(t2) is True:
                return True
            if t2[6] and next_typ in self.sent_starters:
                return True
        if initial or typ == "##number##":
            ortho = self._ortho(t2)
            if ortho is False:
                return False
            if ortho is None and initial and t2[6] and not self.ortho_context.get(next_typ, 0) & ORTHO_LC:
                return False
        return t1[1]

    def contains_sentbreak(self, context: str) -> bool:
        """NLTK's text_contains_sentbreak: some token other than the last one ends a sentence."""
        hit = self._decisions.get(context)
        if hit is not None:
            return hit
        words, get, make = self._words, self._tokens.get, self._token
        if "\n" in context:
            toks = [get(w) or make(w) for line in context.split("\n") if line.strip() for w in words(line)]
        else:
            toks = [get(w) or make(w) for w in words(context)]
        found = False
        for i in range(len(toks) - 1):
            if self._breaks(toks[i], toks[i + 1]):
                found = True
                break
        if len(self._decisions) >= self.MAX_CACHE:
            self._decisions.clear()
        self._decisions[context] = found
        return found

    # -- per text ------------------------------------------------------------------------------------------------
    def spans(self, text: str) -> List[Tuple[int, int]]:
        """(start, end) of each sentence, as NLTK's span_tokenize with realign_boundaries=True."""
        raw: List[Tuple[int, int]] = []
        last_break = 0
        contains = self.contains_sentbreak
        ws = ASCII_WHITESPACE
        last_ws = self._last_ws
        prev: Any = None
        prev_start = prev_stop = 0
        for m in self._period.finditer(text):
            start = m.start()
            # the word before the candidate: after the last ASCII whitespace since the previous candidate's start
            # (a whitespace at that very position counts as none, as in NLTK)
            if start > prev_stop and text[start - 1] in ws:
                last = start - 1
            elif last_ws is not None:
                found = last_ws(text, prev_stop, start)
                last = found.start() if found is not None else -1
            else:
                last = max(text.rfind(c, prev_stop, start) for c in ws)
            word_start = last + 1 if last > prev_stop else prev_start
            # the context: the word before, the candidate and the token after (group 1, right after the match);
            # the next sentence starts at the next token (group 2) or, without one, right after the candidate
            if prev is not None and prev_stop <= word_start and contains(text[prev_start:prev.end(1)]):
                raw.append((last_break, prev.end()))
                last_break = prev.start(2) if prev.start(2) >= 0 else prev.end()
            prev, prev_start, prev_stop = m, word_start, start
        if prev is not None and contains(text[prev_start:prev.end(1)]):
            raw.append((last_break, prev.end()))
            last_break = prev.start(2) if prev.start(2) >= 0 else prev.end()
        raw.append((last_break, len(text.rstrip())))

        out: List[Tuple[int, int]] = []
        realign = 0
        match = self._realign
        n = len(raw)
        for i in range(n):
            s1, e1 = raw[i]
            s1 += realign
            if i == n - 1:
                if s1 < e1:
                    out.append((s1, e1))
                break
            s2, e2 = raw[i + 1]
            m = match(text[s2:e2])
            if m:
                out.append((s1, s2 + len(m.group(0).rstrip())))
                realign = m.end()
            else:
                realign = 0
                if s1 < e1:
                    out.append((s1, e1))
        return out

    def __call__(self, text: str) -> List[str]:
        return [text[s:e] for s, e in self.spans(text)]
