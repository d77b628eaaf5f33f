"""QQP (Megatron's tasks/glue/qqp.py): train/dev have 6 columns ``id qid1 qid2 question1 question2 is_duplicate``,
test has 3 ``id question1 question2`` (label 0 stands in); the header decides."""
from __future__ import annotations

from typing import Any

from tasks.data_utils import TaskDataset
from tasks.glue.data import build_glue_dataset

NUM_CLASSES = 2


def is_test_header(header: list[str]) -> bool:
    return len(header) == 3


def parse_row(row: list[str], is_test: bool) -> tuple[int, str, str, int]:
    if is_test:
        if len(row) != 3:
            raise IndexError(f"{len(row)} columns, a test row has 3")
        return int(row[0]), row[1], row[2], 0
    if len(row) != 6:
        raise IndexError(f"{len(row)} columns, a train/dev row has 6")
    label = int(row[5])
    if label not in (0, 1):
        raise ValueError(f"label {label} is not 0 or 1")
    return int(row[0]), row[3], row[4], label


def build_dataset(paths: list[str], tokenizer: Any, max_seq_length: int, verbose: bool = True) -> TaskDataset:
    return build_glue_dataset("QQP", paths, tokenizer, max_seq_length, is_test_header, parse_row, verbose)
