"""GLUE TSV reading shared by MNLI and QQP (Megatron's tasks/glue/data.py): the header decides train/dev vs test
format, each row becomes a ``[CLS] a [SEP] b [SEP]`` sample, malformed rows are skipped with a counted warning.
A file without its header row (the first line already a data row: its first column is the integer uid) keeps that
row, with one note, where Megatron's reader would silently drop it."""
from __future__ import annotations

from typing import Any, Callable, Optional

from tasks.data_utils import (
    RowCounter,
    TaskDataset,
    build_sample,
    build_tokens_types_paddings_from_ids,
    clean_text,
    dataset_name,
    sorted_files,
    text_lines,
)

# (uid, text_a, text_b, label) or raises ValueError/IndexError with the reason
RowParser = Callable[[list[str], bool], tuple[int, str, str, int]]


def is_header(fields: list[str]) -> bool:
    """A GLUE header row ("index ..." for MNLI, "id ..." for QQP), not a data row (whose first column is its uid)."""
    return not fields[0].strip().isdigit()


def read_glue_rows(path: str, is_test_header: Callable[[list[str]], bool], parse_row: RowParser,
                   verbose: bool = True) -> list[tuple[int, str, str, int]]:
    """(uid, a, b, label) of every usable row of one TSV file (cleaned text, both texts non-empty)."""
    rows: list[tuple[int, str, str, int]] = []
    counter = RowCounter(path, verbose)
    is_test = False
    for lineno, line in text_lines(path):
        if lineno == 1:
            first = line.rstrip("\r\n").split("\t")
            is_test = is_test_header(first)
            if is_header(first):
                continue
            if verbose:
                print(f"note: {path} has no header row (its first line is a data row, uid {first[0].strip()}); "
                      "reading it as data", flush=True)
        if not line.strip():
            continue
        row = [c.strip() for c in line.rstrip("\r\n").split("\t")]
        try:
            uid, a, b, label = parse_row(row, is_test)
        except (IndexError, ValueError, KeyError) as exc:
            counter.skip(lineno, f"index error ({type(exc).__name__}: {exc})")
            continue
        a, b = clean_text(a), clean_text(b)
        if not a or not b:
            counter.skip(lineno, "zero length a" if not a else "zero length b")
            continue
        rows.append((uid, a, b, label))
    counter.finish(len(rows))
    return rows


def build_glue_dataset(task: str, paths: list[str], tokenizer: Any, max_seq_length: int,
                       is_test_header: Callable[[list[str]], bool], parse_row: RowParser,
                       verbose: bool = True, name: Optional[str] = None) -> TaskDataset:
    """One dataset over `paths` (files or directories of *.tsv, sorted), named as Megatron names it."""
    files = [f for p in paths for f in sorted_files(p, "*.tsv")]
    samples = []
    for path in files:
        for uid, a, b, label in read_glue_rows(path, is_test_header, parse_row, verbose):
            ids, types, pads = build_tokens_types_paddings_from_ids(
                tokenizer.tokenize(a), tokenizer.tokenize(b), max_seq_length, tokenizer.cls, tokenizer.sep,
                tokenizer.pad)
            samples.append(build_sample(ids, types, pads, label, uid))
    unlabeled = False
    for path in files:
        with open(path, encoding="utf-8") as f:
            unlabeled |= is_test_header(f.readline().rstrip("\r\n").split("\t"))
    return TaskDataset(name or dataset_name(files[0] if len(files) == 1 else paths[0], task), samples,
                       has_labels=not unlabeled)
