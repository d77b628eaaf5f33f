"""Start-up checks of the training data that would otherwise fail late or not at all (one line each, naming the flag).

- `check_data_files`: every --data-path / --train-data-path / ... prefix holds at least one token, and no token id is
  outside the model's (padded) vocabulary. The largest id is read from the ``.bin`` in 64 MiB chunks (numpy max, a
  few GB/s), skipped when the file's dtype cannot hold an id that large; the result is cached next to the data cache
  so a restart does not read the data again.
- `check_data_prefixes`: every prefix names an existing .bin/.idx pair whose index has a known header; cheap (no data
  read), run by `pretrain` before the model is built so a mistyped path costs seconds, not a model build.
- `check_train_split`: a training run (--train-iters/--train-samples > 0, no --skip-train) whose training split came
  out empty (an empty data set, or --split giving training 0%) stops instead of reporting success.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

import numpy as np

from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    data_file_path,
    index_file_path,
    infer_dataset_impl,
)
from megatron.errors import MegatronUserError
from megatron.run_configs.data_files import DATA_PATH_FLAGS, DataFileSettings

_CHUNK_TOKENS = 32 << 20


class DataCheckError(MegatronUserError, ValueError):
    """The training data cannot give a meaningful run with these flags."""


def data_prefixes(data: DataFileSettings) -> list[tuple[str, str]]:
    """(flag, prefix) for every dataset prefix of the run (blend weights dropped)."""
    out = []
    for flag, attr in DATA_PATH_FLAGS:
        for entry in data.entries(attr):
            try:
                float(entry)
                continue  # a blend weight
            except (TypeError, ValueError):
                out.append((flag, str(entry)))
    return out


def check_data_prefixes(data: DataFileSettings) -> None:
    """One-line DataCheckError naming the flag when a data prefix has no .bin/.idx pair or an unknown index header
    (with --sft: when a JSONL file is missing)."""
    for flag, prefix in data_prefixes(data):
        if data.sft:
            if not os.path.isfile(prefix):
                raise DataCheckError(f"{flag} {prefix}: no such file (--sft reads JSONL files of "
                                     "{\"messages\": [...]} conversations)")
            continue
        missing = [p for p in (index_file_path(prefix), data_file_path(prefix)) if not os.path.isfile(p)]
        if missing:
            hint = next((f"pass the prefix without '{ext}' ({prefix[:-len(ext)]})" for ext in (".bin", ".idx")
                         if prefix.endswith(ext)),
                        f"check {flag}: the prefix tools/preprocess_data.py printed, without .bin/.idx")
            raise DataCheckError(f"{flag} {prefix}: no such dataset (missing {' and '.join(missing)}); {hint}")
        try:
            infer_dataset_impl(prefix)
        except IndexedDatasetError as exc:
            raise DataCheckError(f"{flag} {prefix}: {exc}") from None


def _cache_file(prefix: str) -> str:
    return prefix + ".maxid.json"


def max_token_id(prefix: str) -> Optional[int]:
    """Largest token id in ``prefix.bin`` (None for an empty file); cached in ``prefix.maxid.json`` when writable."""
    bin_path = data_file_path(prefix)
    stat = os.stat(bin_path)
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        with open(_cache_file(prefix)) as f:
            cached = json.load(f)
        if cached.get("key") == key:
            return cached.get("max")
    except (OSError, ValueError):
        pass
    ds = MMapIndexedDataset(prefix, skip_warmup=True)
    total = int(np.asarray(ds.sizes, dtype=np.int64).sum())
    if total == 0:
        return None
    data = np.memmap(bin_path, dtype=ds.dtype, mode="r", shape=(total,))
    best = 0
    for start in range(0, total, _CHUNK_TOKENS):
        best = max(best, int(data[start:start + _CHUNK_TOKENS].max()))
    try:
        with open(_cache_file(prefix) + f".tmp.{os.getpid()}", "w") as f:
            json.dump({"key": key, "max": best}, f)
        os.replace(_cache_file(prefix) + f".tmp.{os.getpid()}", _cache_file(prefix))
    except OSError:
        pass  # read-only data folder: no cache
    return best


def check_data_files(data: DataFileSettings) -> None:
    """One-line DataCheckError for an empty data file or token ids >= the padded vocabulary size. Global rank 0 reads
    the data and tells the others (one broadcast), so a node does not scan the same files once per GPU."""
    dist = sys.modules.get("torch.distributed")
    distributed = dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    message = None
    if not distributed or dist.get_rank() == 0:
        try:
            _check_data_files(data)
        except DataCheckError as exc:
            message = str(exc)
    if distributed:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        raise DataCheckError(message)


def _check_data_files(data: DataFileSettings) -> None:
    vocab = data.padded_vocab_size
    for flag, prefix in data_prefixes(data):
        if infer_dataset_impl(prefix) != "mmap":
            continue  # legacy formats: checked by their readers
        ds = MMapIndexedDataset(prefix, skip_warmup=True)
        tokens = int(np.asarray(ds.sizes, dtype=np.int64).sum()) if len(ds) else 0
        if tokens == 0:
            raise DataCheckError(f"{flag} {prefix}: the data set is empty ({len(ds)} documents, 0 tokens); "
                                 "preprocess a non-empty corpus (tools/preprocess_data.py)")
        if vocab is None or np.iinfo(ds.dtype).max < vocab:
            continue  # the file's dtype cannot hold an id outside the vocabulary
        top = max_token_id(prefix)
        if top is not None and top >= vocab:
            raise DataCheckError(
                f"{flag} {prefix} holds token id {top} but the model's vocabulary has {vocab} entries (padded): the "
                "data was tokenized with another tokenizer; use its --vocab-file/--tokenizer-model or re-preprocess")


def check_train_split(data: DataFileSettings, train_ds: Any) -> None:
    """A training run needs training samples: one line naming --split or --data-path otherwise (`data`: built after
    the model set-up, which turns --train-samples into --train-iters)."""
    if data.skip_train or not (data.train_iters or data.train_samples):
        return
    if train_ds is not None and len(train_ds) > 0:
        return
    length = f"--train-iters {data.train_iters}" if data.train_iters else f"--train-samples {data.train_samples}"
    split = data.split
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    if data.entries("data_path") and parts and float(parts[0]) == 0.0:
        raise DataCheckError(f"--split {split} gives the training split 0% of the data but {length} asks for "
                             "training; give the first --split entry a share, or pass --skip-train to only evaluate")
    flag = "--train-data-path" if data.entries("train_data_path") else "--data-path"
    raise DataCheckError(f"{flag} gives no training samples but {length} asks for training: the training data is "
                         "empty or too small for one sample of --seq-length; check the data, or pass --skip-train")
