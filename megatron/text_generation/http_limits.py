"""Limits every HTTP endpoint of the generation server applies to a request body before parsing it.

Shared by Megatron's `PUT /api` (server.py) and the OpenAI-compatible routes (openai_api.py).
"""
from __future__ import annotations

MAX_JSON_DEPTH = 32  # deepest JSON nesting accepted (deeper: 400 before parsing; no RecursionError)


def json_depth(raw: bytes) -> int:
    """Deepest [ / { nesting of a JSON text (strings skipped), in C-speed passes: regex, translate, numpy cumsum."""
    import re

    import numpy as np

    text = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", raw)
    brackets = np.frombuffer(text.translate(None, bytes(c for c in range(256) if c not in b"[]{}")), dtype=np.uint8)
    if brackets.size == 0:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max())
