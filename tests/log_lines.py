"""Reading Megatron's log lines in tests: the one parser of the per-iteration training line and the validation line
(instead of a loss regex per test file). Prefer the numbers pretrain() returns (tests/training/_workers.py's
curve_from_result) where a test can get them; this is for runs whose only output is their log."""
from __future__ import annotations

import re
from typing import Any, Union

_ITERATION = re.compile(r" iteration +(\d+)/ *\d+ \|([^\n]*)")
_VALIDATION = re.compile(r" validation loss at (.+?) \|([^\n]*)")


def _fields(rest: str) -> dict[str, str]:
    """'key: value | key: value |' -> {key: value} (values as printed)."""
    out = {}
    for part in rest.split("|"):
        key, sep, value = part.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _value(text: str, as_text: bool) -> Union[float, str]:
    return text if as_text else float(text)


def iteration_lines(text: str, key: str = "lm loss", as_text: bool = False) -> list[tuple[int, Any]]:
    """(iteration, value of `key`) for every training log line that has `key`, in order (repeats kept). `as_text`
    keeps the printed digits (exact comparisons, 'nan')."""
    out = []
    for m in _ITERATION.finditer(text):
        fields = _fields(m.group(2))
        if key in fields:
            out.append((int(m.group(1)), _value(fields[key], as_text)))
    return out


def iteration_values(text: str, key: str = "lm loss", as_text: bool = False) -> dict[int, Any]:
    """{iteration: value of `key`} from the training log lines (the last line wins for a repeated iteration)."""
    return dict(iteration_lines(text, key, as_text))


def validation_values(text: str, key: str = "lm loss value", as_text: bool = False) -> list[tuple[str, Any]]:
    """[(where, value of `key`)] from the validation lines ('iteration 10', 'the end of training for val data')."""
    out = []
    for m in _VALIDATION.finditer(text):
        fields = _fields(m.group(2))
        if key in fields:
            out.append((m.group(1), _value(fields[key], as_text)))
    return out


def parse_losses(text: str) -> dict[str, Any]:
    """{'train': {iteration: lm loss}, 'val': [(where, lm loss)]} from the printed log lines."""
    return {"train": iteration_values(text), "val": validation_values(text)}
