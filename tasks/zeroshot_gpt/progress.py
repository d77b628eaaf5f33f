"""Evaluation progress on stderr: a tqdm bar on a terminal, plain periodic lines when stderr is redirected to a log.

A bar redrawn with `\\r` turns a log file into one very long line; with a non-terminal stream this prints a line at
every 10% of the batches (and at the end) instead, e.g. `evaluating: 40/133 batches (30%), 12.5 s`.
"""
from __future__ import annotations

import sys
import time
from typing import IO, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


def _is_terminal(stream: IO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def progress(items: Iterable[T], total: int, desc: str = "evaluating", stream: Optional[IO] = None,
             steps: int = 10) -> Iterator[T]:
    """Yield `items`, reporting progress on `stream` (default stderr): tqdm on a terminal, else `steps` plain lines."""
    stream = stream if stream is not None else sys.stderr
    if _is_terminal(stream):
        from tqdm import tqdm

        yield from tqdm(items, total=total, desc=desc, file=stream, dynamic_ncols=True)
        return
    start, next_mark = time.time(), 1
    done = 0
    for item in items:
        yield item
        done += 1
        if total > 0 and (done * steps >= next_mark * total or done == total):
            print(f"{desc}: {done}/{total} batches ({100 * done // total}%), {time.time() - start:.1f} s",
                  file=stream, flush=True)
            next_mark = done * steps // total + 1
