"""The parts of Megatron's `.bin`/`.idx` format that the mmap reader/writer (indexed_dataset.py) and the legacy
lazy/cached ones (legacy_indexed_dataset.py) share: dtype codes, magics, file names, bounds and document-index checks,
the one-line error. Both modules import it (neither imports the other at module level). No torch here.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Optional, Sequence, Union

import numpy as np

from megatron.errors import MegatronUserError

PathLike = Union[str, "os.PathLike[str]"]

# Megatron's dtype codes (stored in the .idx header).
DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
dtypes = DTYPES  # Megatron's name for the same table
CODES: dict[np.dtype, int] = {np.dtype(t): c for c, t in DTYPES.items()}

RERUN_HINT = "re-run tools/preprocess_data.py to rebuild the pair"
COPY_CHUNK = 16 << 20  # bytes per read when streaming .bin files (bounded memory)
FLUSH = 1 << 20  # python-list entries kept before packing into numpy chunks


class IndexedDatasetError(MegatronUserError, ValueError):
    """A .bin/.idx pair is missing, truncated, corrupt or inconsistent (the message names the file and the fix)."""


def get_available_dataset_impl() -> list[str]:
    return ["lazy", "cached", "mmap"]


def code(dtype: Any) -> int:
    """The header code of a numpy dtype (ValueError for dtypes the format cannot store)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    try:
        return CODES[dt]
    except KeyError:
        names = ", ".join(np.dtype(t).name for t in DTYPES.values())
        raise ValueError(f"indexed datasets cannot store dtype {dt}; use one of {names}") from None


def little_endian(dtype: Any) -> np.dtype:
    """Little-endian version of a supported dtype (the on-disk byte order)."""
    code(dtype)
    return np.dtype(dtype).newbyteorder("<")


def best_fitting_dtype(vocab_size: Optional[int] = None) -> type:
    """Megatron's token dtype choice: uint16 when the vocabulary fits (< 65500 ids), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def index_file_path(prefix_path: PathLike) -> str:
    return os.fspath(prefix_path) + ".idx"


def data_file_path(prefix_path: PathLike) -> str:
    return os.fspath(prefix_path) + ".bin"


def temporary_path(path: str) -> str:
    """The per-process temporary name `path` is written under before it is renamed into place."""
    return f"{path}.tmp-{os.getpid()}"


def missing_hint(prefix: str) -> str:
    """A hint for a prefix given with its .bin/.idx extension (empty otherwise)."""
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            return f" (pass the prefix without '{ext}': {prefix[: -len(ext)]})"
    return ""


def checked_file_size(path: str, prefix: str) -> int:
    """Size of `path` in bytes; the one-line IndexedDatasetError naming both files of `prefix` when it is missing."""
    try:
        return os.path.getsize(path)
    except OSError:
        raise IndexedDatasetError(
            f"{path} not found: a dataset prefix needs both {prefix}.bin and {prefix}.idx{missing_hint(prefix)}; "
            "check --data-path or run tools/preprocess_data.py"
        ) from None


def warmup_mmap_file(path: str) -> None:
    """Read the whole file once (100 MiB at a time) so the page cache holds it before it is memory-mapped."""
    with open(path, "rb") as stream:
        while stream.read(100 * (1 << 20)):
            pass


@functools.cache
def narrowing_bounds(src: np.dtype, dst: np.dtype) -> Optional[tuple[int, int]]:
    """(min, max) of ``dst`` when casting integers ``src`` -> ``dst`` may lose values, else None (cached per pair)."""
    if src.kind not in "iub" or dst.kind not in "iu" or np.can_cast(src, dst):
        return None
    info = np.iinfo(dst)
    return int(info.min), int(info.max)


def to_numpy(item: Any, dtype: np.dtype, what: str) -> np.ndarray:
    """Convert a list, numpy array or (CPU/GPU) torch tensor to a C-contiguous array of the builder's dtype."""
    if not isinstance(item, np.ndarray):
        if hasattr(item, "detach") and hasattr(item, "cpu"):  # torch.Tensor, without importing torch
            item = item.detach().cpu().numpy()
        elif hasattr(item, "numpy") and not isinstance(item, (list, tuple)):
            item = item.numpy()
    if isinstance(item, np.ndarray):
        if item.dtype != dtype and item.size:
            bounds = narrowing_bounds(item.dtype, dtype)
            if bounds is not None:
                lo, hi = int(item.min()), int(item.max())
                if lo < bounds[0] or hi > bounds[1]:
                    raise IndexedDatasetError(
                        f"{what}: token id {hi if hi > bounds[1] else lo} does not fit the builder's dtype {dtype.name} "
                        f"(range {bounds[0]}..{bounds[1]}); build with vocab_size >= 65500 (int32 tokens)"
                    )
        return np.ascontiguousarray(item, dtype=dtype)
    try:
        if isinstance(item, list) and dtype.kind in "iu":
            try:  # fastest path for flat lists of python ints (the preprocessing hot path)
                return np.fromiter(item, dtype=dtype, count=len(item))
            except (TypeError, ValueError):  # nested lists, strings, ...: let numpy sort it out below
                pass
        return np.ascontiguousarray(item, dtype=dtype)
    except OverflowError as exc:
        raise IndexedDatasetError(
            f"{what}: {exc}; the token ids do not fit {dtype.name} — build with vocab_size >= 65500 (int32 tokens)"
        ) from None


def check_doc_idx(doc_idx: np.ndarray, limit: int, path: str) -> None:
    """Validate a document index (starts at 0, monotone, ends within `limit` sequences); IndexedDatasetError otherwise."""
    if len(doc_idx) == 0:
        raise IndexedDatasetError(f"{path} has an empty document index (it must start with 0); {RERUN_HINT}")
    if doc_idx[0] != 0:
        raise IndexedDatasetError(f"{path}: doc_idx[0] is {int(doc_idx[0])}, expected 0; the index is corrupt; {RERUN_HINT}")
    steps = np.diff(doc_idx)
    if len(steps) and steps.min() < 0:
        bad = int(np.argmax(steps < 0)) + 1
        raise IndexedDatasetError(
            f"{path}: doc_idx is not monotone (doc_idx[{bad}] = {int(doc_idx[bad])} < doc_idx[{bad - 1}] = "
            f"{int(doc_idx[bad - 1])}); the index is corrupt; {RERUN_HINT}"
        )
    if doc_idx[-1] > limit:
        raise IndexedDatasetError(
            f"{path}: doc_idx ends at {int(doc_idx[-1])} but the index holds only {limit} sequences; "
            f"the index is corrupt; {RERUN_HINT}"
        )


def create_doc_idx(sizes: Sequence[int]) -> np.ndarray:
    """Megatron's helper: document boundaries from sizes where an empty sequence ends a document."""
    doc_idx = [0]
    for i, s in enumerate(sizes):
        if s == 0:
            doc_idx.append(i + 1)
    return np.asarray(doc_idx, dtype=np.int64)


MMAP_MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
