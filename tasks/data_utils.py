"""Shared finetuning data pieces (Megatron's tasks/data_utils.py): text cleaning, the ``[CLS] a [SEP] b [SEP]``
sample with token types and padding, dataset names, file listing, and the row-level warnings/errors of the parsers.

A sample is ``{'text', 'types', 'padding_mask', 'label', 'uid'}`` (int64 arrays of length seq_length; for RACE the
arrays are [choices, seq_length]), as Megatron's datasets return it.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from megatron.errors import MegatronUserError


class TaskDataError(MegatronUserError, ValueError):
    """A finetuning data file that cannot be used (one line naming the file and the fix)."""


def clean_text(text: str) -> str:
    """Megatron's clean_text: newlines to spaces, runs of whitespace to one space, ' . ' -> '. ' (three passes)."""
    text = text.replace("\n", " ")
    text = re.sub(r"\s+", " ", text)
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def build_tokens_types_paddings_from_ids(a_ids: Sequence[int], b_ids: Optional[Sequence[int]], max_seq_length: int,
                                         cls_id: int, sep_id: int, pad_id: int
                                         ) -> tuple[list[int], list[int], list[int]]:
    """[CLS] a [SEP] b [SEP], types 0.. 1.., cut to seq_length-1 from the end (b first), padded with pad_id."""
    ids = [cls_id, *a_ids, sep_id]
    types = [0] * len(ids)
    if b_ids is not None:
        ids.extend(b_ids)
        types.extend([1] * len(b_ids))
    trimmed = False
    if len(ids) >= max_seq_length:
        ids, types, trimmed = ids[:max_seq_length - 1], types[:max_seq_length - 1], True
    if b_ids is not None or trimmed:
        ids.append(sep_id)
        types.append(1 if b_ids is not None else 0)
    paddings = [1] * len(ids)
    pad = max_seq_length - len(ids)
    return ids + [pad_id] * pad, types + [pad_id] * pad, paddings + [0] * pad


def build_sample(ids: Any, types: Any, paddings: Any, label: int, uid: int) -> dict:
    return {"text": np.array(ids, dtype=np.int64), "types": np.array(types, dtype=np.int64),
            "padding_mask": np.array(paddings, dtype=np.int64), "label": int(label), "uid": int(uid)}


def dataset_name(path: str, marker: str) -> str:
    """Megatron's names: `.../MNLI/dev_matched.tsv` -> dev-matched (the file stem when `marker` is not in the path)."""
    if marker in path:
        tail = path.split(marker)[-1]
    else:
        tail = os.path.basename(path.rstrip("/"))
    tail = tail.strip("/")
    if tail.endswith(".tsv"):
        tail = tail[:-4]
    return tail.replace("/", "-").replace("_", "-")


def sorted_files(path: str, pattern: str) -> list[str]:
    """A directory's files matching `pattern`, or the file itself; sorted (stable uids, unlike Megatron's glob).
    A directory without any is a one-line TaskDataError (it would otherwise evaluate ``0 / 0``)."""
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", pattern), recursive=True) if os.path.isfile(f))
        if not files:
            raise TaskDataError(f"{path}: no {pattern} files in this folder (searched its subfolders too); check "
                                "--train-data/--valid-data")
        return files
    if not os.path.exists(path):
        raise TaskDataError(f"{path}: no such file or directory; check --train-data/--valid-data")
    return [path]


def text_lines(path: str, start: int = 1) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file; a file that is not text (e.g. binary) is a one-line TaskDataError
    naming the file and the line."""
    lineno = start - 1
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=start):
                yield lineno, line
    except UnicodeDecodeError as exc:
        raise TaskDataError(f"{path}: not UTF-8 text near line {lineno + 1} (byte 0x{exc.object[exc.start]:02x}); "
                            "is it the right file (a binary or compressed file)?") from None


class RowCounter:
    """Counts skipped rows per file and prints Megatron's ``***WARNING***`` line for each (first 10 per file)."""

    def __init__(self, path: str, verbose: bool = True) -> None:
        self.path, self.skipped, self.verbose = path, 0, verbose

    def skip(self, line: int, why: str) -> None:
        self.skipped += 1
        if self.verbose and self.skipped <= 10:
            print(f"***WARNING*** {self.path}:{line}: {why}, skipping", flush=True)

    def finish(self, kept: int) -> None:
        if self.skipped and self.verbose:
            print(f"***WARNING*** {self.path}: skipped {self.skipped} malformed row(s), kept {kept}", flush=True)
        if kept == 0:
            raise TaskDataError(f"{self.path}: no usable rows ({self.skipped} malformed); check the file format")


class TaskDataset(torch.utils.data.Dataset):
    """A list of samples with a name (``dev-matched``) and the uids in file order."""

    def __init__(self, name: str, samples: list[dict], sample_multiplier: int = 1, has_labels: bool = True) -> None:
        self.dataset_name = name
        self.samples = samples
        self.sample_multiplier = sample_multiplier
        self.has_labels = has_labels  # False for GLUE test files (placeholder labels): predictions, no accuracy

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict:
        return self.samples[idx]


def _rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def concat_names(paths: Iterable[str]) -> str:
    return ", ".join(paths)
