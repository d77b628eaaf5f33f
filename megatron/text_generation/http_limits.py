"""Limits every HTTP endpoint of the generation server applies to a request body before parsing it.

Shared by Megatron's `PUT /api` (server.py) and the OpenAI-compatible routes (openai_api.py). Every check here is a
fixed number of vectorised passes over the body (no regular expression, no backtracking): its cost is linear in the
body, so a hostile body cannot hold the interpreter for long and other clients keep being served.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

MAX_JSON_DEPTH = 32  # deepest JSON nesting accepted (deeper: 400 before parsing; no RecursionError)

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPENS, _CLOSES = (ord("["), ord("{")), (ord("]"), ord("}"))


def json_depth(raw: bytes, work: Optional[list[int]] = None) -> int:
    """Deepest [ / { nesting of a JSON text, brackets inside strings skipped, in linear vectorised passes.

    A quote opens or closes a string unless an odd run of backslashes precedes it; a bracket counts when an even
    number of such quotes precedes it. On invalid JSON the answer is exact up to the first syntax error (which is as
    far as the parser goes). `work`, when given, receives the number of array elements each pass touched.
    """
    body = np.frombuffer(raw, dtype=np.uint8)
    n = body.size
    passes = 0
    if n == 0:
        return 0
    index = np.arange(n, dtype=np.int64)
    last_plain = np.where(body != _BACKSLASH, index, -1)  # last position <= i that is not a backslash
    np.maximum.accumulate(last_plain, out=last_plain)
    quotes = np.flatnonzero(body == _QUOTE)
    passes += 4
    before = quotes - 1
    run = before - np.where(before >= 0, last_plain[np.maximum(before, 0)], -1)  # backslashes right before a quote
    delimiters = np.zeros(n, dtype=np.int8)
    delimiters[quotes[run % 2 == 0]] = 1
    in_string = np.bitwise_xor.accumulate(delimiters)
    passes += 2
    opens = (body == _OPENS[0]) | (body == _OPENS[1])
    closes = (body == _CLOSES[0]) | (body == _CLOSES[1])
    steps = (opens.view(np.int8) - closes.view(np.int8)) * (in_string == 0)
    depth = np.cumsum(steps, dtype=np.int64).max()
    passes += 4
    if work is not None:
        work.append(passes * n + 4 * quotes.size)
    return max(int(depth), 0)
