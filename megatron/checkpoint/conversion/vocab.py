"""Vocabulary sizes and padding as Megatron's checkpoint tools handle them."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megatron.checkpoint.conversion.interchange import ConversionError
from megatron.tokenizer.tokenizer import vocab_size_with_padding


def true_vocab_size_from_file(path: str) -> int:
    """Entries of a GPT-2 ``vocab.json`` (Megatron's loader reads it with json.load) or lines of a ``vocab.txt``."""
    if not os.path.isfile(path):
        raise ConversionError(f"--vocab-file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return len(json.loads(text))
    except json.JSONDecodeError:
        return sum(1 for line in text.splitlines() if line.strip())


def repad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Cut to `rows`, or fill the missing rows by repeating the last row (Megatron's saver, output layer too)."""
    if t.size(0) == rows:
        return t
    if t.size(0) > rows:
        return t[:rows].clone()
    return torch.cat([t, t[-1:].expand(rows - t.size(0), *t.shape[1:])], dim=0)


def target_rows(current_rows: int, true_vocab_size: Optional[int], divisible_by: int, tp: int) -> int:
    """Padded vocabulary rows for a target tensor-parallel size."""
    if true_vocab_size is not None:
        return vocab_size_with_padding(true_vocab_size, divisible_by, tp)
    if current_rows % tp:
        raise ConversionError(f"the vocabulary has {current_rows} rows, not divisible by --target-tensor-parallel-size "
                              f"{tp}: pass --true-vocab-size N or --vocab-file to re-pad it")
    return current_rows
