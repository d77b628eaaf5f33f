"""MNLI (Megatron's tasks/glue/mnli.py): sentence1 = column 8, sentence2 = column 9, gold label = last column;
a 10-column header marks a test file (no labels: ``contradiction`` = 0 stands in)."""
from __future__ import annotations

from typing import Any

from tasks.data_utils import TaskDataset
from tasks.glue.data import build_glue_dataset

LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}
NUM_CLASSES = 3


def is_test_header(header: list[str]) -> bool:
    return len(header) == 10


def parse_row(row: list[str], is_test: bool) -> tuple[int, str, str, int]:
    if is_test:
        if len(row) != 10:
            raise IndexError(f"{len(row)} columns, a test row has 10")
        return int(row[0]), row[8], row[9], LABELS["contradiction"]
    if len(row) < 11:
        raise IndexError(f"{len(row)} columns, a train/dev row has at least 11")
    if row[-1] not in LABELS:
        raise KeyError(f"label {row[-1]!r} is not one of {sorted(LABELS)}")
    return int(row[0]), row[8], row[9], LABELS[row[-1]]


def build_dataset(paths: list[str], tokenizer: Any, max_seq_length: int, verbose: bool = True) -> TaskDataset:
    return build_glue_dataset("MNLI", paths, tokenizer, max_seq_length, is_test_header, parse_row, verbose)
