"""Indexed token datasets: Megatron's binary `.bin`/`.idx` pairs, byte-compatible with Megatron-LM.

Two on-disk formats:

* ``mmap`` (default): ``.bin`` holds the raw tokens; ``.idx`` is the magic ``MMIDIDX\\x00\\x00``, version (u64 = 1),
  dtype code (u8), N (u64, sequences), D (u64, doc_idx entries), then sizes int32[N], pointers int64[N] (byte offset
  of each sequence in ``.bin``) and doc_idx int64[D]. Reads are zero-copy views of a memory map.
* legacy ``lazy``/``cached``: ``.idx`` is the magic ``TNTIDX\\x00\\x00``, version, dtype code, element size, N, S
  (number of size entries), D, then dim_offsets int64[N+1], data_offsets int64[N+1] (in elements), sizes int64[S] and
  doc_idx int64[D]. Implemented in legacy_indexed_dataset.py and re-exported here.

Writers write under temporary names and rename on ``finalize`` (``.bin`` first, then ``.idx``), so an interrupted
run never leaves a pair that looks finished. Opening a pair checks it thoroughly and reports any inconsistency as a
one-line :class:`IndexedDatasetError`. This module does not import torch (torch tensors are accepted by duck typing).
"""
from __future__ import annotations

import os
import shutil
import struct
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from megatron.core.rank_print import print_rank_0 as _print_rank_0
from megatron.data.index_format import (  # noqa: F401  (re-exported: Megatron's names and the legacy module's)
    CODES,
    COPY_CHUNK,
    DTYPES,
    FLUSH,
    LEGACY_MAGIC,
    MMAP_MAGIC,
    RERUN_HINT,
    IndexedDatasetError,
    PathLike,
    best_fitting_dtype,
    check_doc_idx,
    checked_file_size,
    code,
    create_doc_idx,
    data_file_path,
    dtypes,
    get_available_dataset_impl,
    index_file_path,
    little_endian,
    missing_hint,
    narrowing_bounds,
    temporary_path,
    to_numpy,
    warmup_mmap_file,
)
from megatron.data.legacy_indexed_dataset import (  # noqa: F401  (re-exported: Megatron's names)
    IndexedCachedDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    legacy_index_size,
    read_longs,
    write_longs,
)

# --------------------------------------------------------------------------------------------------------------------
# mmap format
# --------------------------------------------------------------------------------------------------------------------
_MMAP_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D  (34 bytes)


def mmap_index_size(num_sequences: int, num_doc_idx: int) -> int:
    """Size in bytes of an mmap .idx file: 34 + 12 N + 8 D."""
    return _MMAP_HEADER.size + 12 * num_sequences + 8 * num_doc_idx


def _pointers_from_sizes(sizes: np.ndarray, itemsize: int) -> np.ndarray:
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= itemsize
    return pointers


class _MMapIndexWriter:
    """Context manager writing an mmap .idx file: ``with Index.writer(path, dtype) as w: w.write(sizes, doc_idx)``."""

    def __init__(self, path: PathLike, dtype: Any) -> None:
        self._path = os.fspath(path)
        self._dtype = little_endian(dtype)
        self._file = None

    def __enter__(self) -> _MMapIndexWriter:
        self._file = open(self._path, "wb")
        return self

    def write(self, sizes: Iterable[int], doc_idx: Iterable[int]) -> None:
        sizes64 = np.asarray(sizes, dtype=np.int64).reshape(-1)
        if len(sizes64) and (sizes64.min() < 0 or sizes64.max() > np.iinfo(np.int32).max):
            raise IndexedDatasetError(f"{self._path}: sequence sizes must lie in 0..2**31-1 to fit the int32 sizes array")
        doc = np.asarray(doc_idx, dtype="<i8").reshape(-1)
        check_doc_idx(doc, len(sizes64), self._path)
        pointers = _pointers_from_sizes(sizes64, self._dtype.itemsize)
        f = self._file
        f.write(_MMAP_HEADER.pack(MMAP_MAGIC, 1, code(self._dtype), len(sizes64), len(doc)))
        f.write(sizes64.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
        f.write(doc.tobytes(order="C"))

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self._file.close()


class MMapIndex:
    """The .idx of an mmap dataset (Megatron's ``MMapIndexedDataset.Index``), validated on open."""

    _HDR_MAGIC = MMAP_MAGIC

    @classmethod
    def writer(cls, path: PathLike, dtype: Any) -> _MMapIndexWriter:
        return _MMapIndexWriter(path, dtype)

    def __init__(self, path: PathLike, skip_warmup: bool = True, *, verbose: bool = False) -> None:
        self._path = path = os.fspath(path)
        prefix = path[:-4] if path.endswith(".idx") else path
        file_size = checked_file_size(path, prefix)
        if file_size < _MMAP_HEADER.size:
            raise IndexedDatasetError(
                f"{path} is {file_size} bytes, shorter than the {_MMAP_HEADER.size}-byte mmap index header; "
                f"the index is truncated; {RERUN_HINT}"
            )
        with open(path, "rb") as stream:
            magic, version, dtype_code, n, d = _MMAP_HEADER.unpack(stream.read(_MMAP_HEADER.size))
        if magic != MMAP_MAGIC:
            if magic[:8] == LEGACY_MAGIC:
                raise IndexedDatasetError(
                    f"{path} is a legacy (lazy/cached) index, not mmap; use --data-impl infer (or lazy/cached)"
                )
            raise IndexedDatasetError(
                f"{path} is not an mmap index: magic {magic!r} != {MMAP_MAGIC!r}; wrong file or corrupt; {RERUN_HINT}"
            )
        if version != 1:
            raise IndexedDatasetError(f"{path}: unsupported mmap index version {version} (only version 1 exists); {RERUN_HINT}")
        if dtype_code not in DTYPES:
            raise IndexedDatasetError(
                f"{path}: unknown dtype code {dtype_code} in the header (valid codes 1..8); the index is corrupt; {RERUN_HINT}"
            )
        expected = mmap_index_size(n, d)
        if file_size != expected:
            state = "truncated" if file_size < expected else "has trailing bytes"
            raise IndexedDatasetError(
                f"{path} is {file_size} bytes but its header promises {n} sequences and {d} doc_idx entries = "
                f"34 + 12*{n} + 8*{d} = {expected} bytes; the index is {state} or corrupt; {RERUN_HINT}"
            )
        self._dtype = little_endian(DTYPES[dtype_code])
        self._len = n
        self._doc_count = d
        if not skip_warmup:
            if verbose:
                _print_rank_0("    warming up index mmap file...")
            warmup_mmap_file(path)
        self._bin_buffer_mmap = np.memmap(path, mode="r", order="C")
        self._bin_buffer = memoryview(self._bin_buffer_mmap)
        offset = _MMAP_HEADER.size
        if verbose:
            _print_rank_0("    reading sizes...")
        self._sizes = np.frombuffer(self._bin_buffer, dtype="<i4", count=n, offset=offset)
        if verbose:
            _print_rank_0("    reading pointers...")
        self._pointers = np.frombuffer(self._bin_buffer, dtype="<i8", count=n, offset=offset + 4 * n)
        if verbose:
            _print_rank_0("    reading document index...")
        self._doc_idx = np.frombuffer(self._bin_buffer, dtype="<i8", count=d, offset=offset + 12 * n)
        self._validate()

    def _validate(self) -> None:
        path, sizes = self._path, self._sizes
        if self._len:
            if sizes.min() < 0:
                bad = int(np.argmax(sizes < 0))
                raise IndexedDatasetError(f"{path}: sizes[{bad}] = {int(sizes[bad])} is negative; the index is corrupt; {RERUN_HINT}")
            expected = _pointers_from_sizes(sizes, self._dtype.itemsize)
            if not np.array_equal(expected, self._pointers):
                bad = int(np.argmax(expected != self._pointers))
                raise IndexedDatasetError(
                    f"{path}: pointers[{bad}] = {int(self._pointers[bad])} but the sizes before it imply "
                    f"{int(expected[bad])}; the index is corrupt; {RERUN_HINT}"
                )
        check_doc_idx(self._doc_idx, self._len, path)

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    @property
    def total_bytes(self) -> int:
        """Size the matching .bin must have."""
        if not self._len:
            return 0
        return int(self._pointers[-1]) + int(self._sizes[-1]) * self._dtype.itemsize

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[int, int]:
        n = self._len
        if not -n <= i < n:
            raise IndexError(f"sequence index {i} out of range for {self._path} with {n} sequences")
        return int(self._pointers[i]), int(self._sizes[i])


def check_bin_size(prefix: str, index: MMapIndex) -> int:
    """Size of ``prefix.bin``; IndexedDatasetError unless it is exactly what ``index`` describes."""
    bin_path = data_file_path(prefix)
    bin_size = checked_file_size(bin_path, prefix)
    expected = index.total_bytes
    if bin_size != expected:
        item = index.dtype.itemsize
        tokens = expected // item
        state = "truncated" if bin_size < expected else "too long"
        raise IndexedDatasetError(
            f"{bin_path} holds {bin_size} bytes but {index_file_path(prefix)} promises {expected} = {tokens} tokens x "
            f"{item} bytes; the .bin is {state} or belongs to another index; {RERUN_HINT}"
        )
    return bin_size


class MMapIndexedDataset:
    """Memory-mapped reader of an mmap ``prefix.bin``/``prefix.idx`` pair; items are zero-copy numpy views."""

    Index = MMapIndex

    def __init__(self, path: PathLike, skip_warmup: bool = True) -> None:
        self._do_init(os.fspath(path), skip_warmup, verbose=True)

    def __getstate__(self) -> dict:
        return {"path": self._path}

    def __setstate__(self, state: Any) -> None:
        path = state["path"] if isinstance(state, dict) else state
        self._do_init(path, True, verbose=False)

    def _do_init(self, path: str, skip_warmup: bool, verbose: bool) -> None:
        self._path = path
        self._index = MMapIndex(index_file_path(path), skip_warmup, verbose=verbose)
        bin_size = check_bin_size(path, self._index)
        if not skip_warmup:
            if verbose:
                _print_rank_0("    warming up data mmap file...")
            warmup_mmap_file(data_file_path(path))
        if verbose:
            _print_rank_0("    creating numpy buffer of mmap...")
        if bin_size:
            self._bin_buffer_mmap = np.memmap(data_file_path(path), mode="r", order="C")
            if verbose:
                _print_rank_0("    creating memory view of numpy buffer...")
            self._bin_buffer = memoryview(self._bin_buffer_mmap)
        else:  # numpy cannot map an empty file
            self._bin_buffer_mmap = None
            self._bin_buffer = memoryview(b"")

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, idx: Union[int, slice]) -> Union[np.ndarray, list[np.ndarray]]:
        if isinstance(idx, (int, np.integer)):
            ptr, size = self._index[int(idx)]
            return np.frombuffer(self._bin_buffer, dtype=self._index.dtype, count=size, offset=ptr)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices into an indexed dataset must be contiguous (step 1), got step {step}")
            if start >= stop:
                return []
            sizes = self._index.sizes[start:stop]
            total = int(sizes.sum(dtype=np.int64))
            ptr = int(self._index.pointers[start])
            arr = np.frombuffer(self._bin_buffer, dtype=self._index.dtype, count=total, offset=ptr)
            return np.split(arr, np.cumsum(sizes[:-1], dtype=np.int64))
        raise TypeError(f"indexed datasets are indexed by int or slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None), zero-copy."""
        ptr, size = self._index[int(idx)]
        offset = int(offset)
        if length is None:
            length = size - offset
        length = int(length)
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"get({idx}, offset={offset}, length={length}) is outside sequence {idx} of {self._path} ({size} tokens)"
            )
        ptr += offset * self._index.dtype.itemsize
        return np.frombuffer(self._bin_buffer, dtype=self._index.dtype, count=length, offset=ptr)

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    @property
    def doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    def get_doc_idx(self) -> np.ndarray:
        return self._index._doc_idx

    def set_doc_idx(self, doc_idx_: np.ndarray) -> None:
        self._index._doc_idx = doc_idx_

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(path: PathLike) -> bool:
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


class MMapIndexedDatasetBuilder:
    """Writes an mmap pair. Hot path: ``add_doc`` writes the bytes directly and appends sizes to a python list."""

    def __init__(self, out_file: PathLike, dtype: Any = np.int64) -> None:
        self._out_file = os.fspath(out_file)
        self._dtype = little_endian(dtype)
        self._tmp_bin = temporary_path(self._out_file)
        self._data_file = open(self._tmp_bin, "wb")
        self._sizes: list[int] = []  # recent sizes (python ints); older ones are packed into _size_chunks
        self._size_chunks: list[np.ndarray] = []
        self._num_packed = 0
        self._doc_idx: list[int] = [0]
        self._doc_chunks: list[np.ndarray] = []
        self._finalized = False

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def _count(self) -> int:
        return self._num_packed + len(self._sizes)

    def _pack(self) -> None:
        if self._sizes:
            self._size_chunks.append(np.asarray(self._sizes, dtype=np.int64))
            self._num_packed += len(self._sizes)
            self._sizes = []
        if self._doc_idx:
            self._doc_chunks.append(np.asarray(self._doc_idx, dtype=np.int64))
            self._doc_idx = []

    def add_item(self, tensor: Any) -> None:
        """Append one sequence (flattened)."""
        arr = to_numpy(tensor, self._dtype, self._out_file)
        self._data_file.write(arr.reshape(-1))
        self._sizes.append(arr.size)
        if len(self._sizes) >= FLUSH:
            self._pack()

    def add_doc(self, tokens: Any, lengths: Sequence[int]) -> None:
        """Append a whole document: ``tokens`` is its sentences concatenated, ``lengths`` the sentence sizes."""
        arr = to_numpy(tokens, self._dtype, self._out_file).reshape(-1)
        lengths = lengths.tolist() if hasattr(lengths, "tolist") else list(lengths)  # numpy / torch / list
        if sum(lengths) != arr.size:
            raise IndexedDatasetError(
                f"{self._out_file}: add_doc got {arr.size} tokens but sentence lengths summing to {sum(lengths)}"
            )
        self._data_file.write(arr)
        self._sizes.extend(lengths)
        self._doc_idx.append(self._count())
        if len(self._sizes) >= FLUSH or len(self._doc_idx) >= FLUSH:
            self._pack()

    def end_document(self) -> None:
        self._doc_idx.append(self._count())

    def merge_file_(self, another_file: PathLike) -> None:
        """Append another mmap pair (by prefix); its tokens are streamed in bounded-memory chunks."""
        prefix = os.fspath(another_file)
        index = MMapIndex(index_file_path(prefix))
        check_bin_size(prefix, index)
        if index.dtype != self._dtype:
            raise IndexedDatasetError(
                f"cannot merge {prefix}: its tokens are {index.dtype.name} but {self._out_file} holds "
                f"{self._dtype.name}; preprocess every part with the same tokenizer (vocab < 65500 gives uint16, "
                "else int32)"
            )
        offset = self._count()
        self._pack()
        self._size_chunks.append(np.array(index.sizes, dtype=np.int32))  # a private copy, 4 bytes per sequence
        self._num_packed += len(index)
        self._doc_chunks.append(np.asarray(index.doc_idx[1:], dtype=np.int64) + offset)
        with open(data_file_path(prefix), "rb") as stream:
            shutil.copyfileobj(stream, self._data_file, COPY_CHUNK)

    def abort(self) -> None:
        """Close and delete the temporary files without producing a dataset."""
        if not self._finalized:
            self._data_file.close()
            if os.path.exists(self._tmp_bin):
                os.remove(self._tmp_bin)
            self._finalized = True

    def finalize(self, index_file: PathLike) -> None:
        """Write the index and publish the pair: rename ``.bin`` into place, then ``.idx``."""
        if self._finalized:
            raise RuntimeError(f"builder for {self._out_file} was already finalized or aborted")
        self._finalized = True
        self._data_file.close()
        self._pack()
        sizes = np.concatenate(self._size_chunks) if self._size_chunks else np.zeros(0, np.int64)
        doc_idx = np.concatenate(self._doc_chunks)
        index_file = os.fspath(index_file)
        tmp_idx = temporary_path(index_file)
        try:
            with MMapIndex.writer(tmp_idx, self._dtype) as writer:
                writer.write(sizes, doc_idx)
            os.replace(self._tmp_bin, self._out_file)
            os.replace(tmp_idx, index_file)
        except BaseException:
            for p in (self._tmp_bin, tmp_idx):
                if os.path.exists(p):
                    os.remove(p)
            raise


__all__ = [
    "best_fitting_dtype", "check_bin_size", "code", "create_doc_idx", "data_file_path", "dataset_exists", "DTYPES",
    "get_available_dataset_impl", "index_file_path", "IndexedCachedDataset", "IndexedDataset",
    "IndexedDatasetBuilder", "IndexedDatasetError", "infer_dataset_impl", "legacy_index_size", "make_builder",
    "make_dataset", "MMapIndex", "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "read_longs", "write_longs",
]


# --------------------------------------------------------------------------------------------------------------------
# Module-level entry points (Megatron's names); the legacy classes are re-exported lazily (module __getattr__)
# --------------------------------------------------------------------------------------------------------------------
def infer_dataset_impl(path: PathLike) -> Optional[str]:
    """'mmap' or 'cached' from the .idx magic; None when the pair does not exist."""
    path = os.fspath(path)
    if not _pair_exists(path):
        _print_rank_0(f"Dataset does not exist: {path}")
        return None
    with open(index_file_path(path), "rb") as stream:
        magic = stream.read(9)
    if magic[:8] == LEGACY_MAGIC:
        return "cached"
    if magic == MMAP_MAGIC:
        return "mmap"
    raise IndexedDatasetError(
        f"{index_file_path(path)} starts with {magic!r}, neither an mmap ({MMAP_MAGIC!r}) nor a legacy "
        f"({LEGACY_MAGIC!r}) index; wrong file or corrupt; {RERUN_HINT}"
    )


def make_builder(out_file: PathLike, impl: str = "mmap", vocab_size: Optional[int] = None,
                 dtype: Any = None) -> Union[MMapIndexedDatasetBuilder, IndexedDatasetBuilder]:
    """Builder for ``out_file`` (the .bin path). Token dtype: ``dtype`` if given, else best_fitting_dtype(vocab_size)
    for mmap and int32 for the legacy formats (as Megatron)."""
    if impl == "mmap":
        return MMapIndexedDatasetBuilder(out_file, dtype=best_fitting_dtype(vocab_size) if dtype is None else dtype)
    if impl in ("lazy", "cached"):
        return IndexedDatasetBuilder(out_file, dtype=np.int32 if dtype is None else dtype)
    raise ValueError(f"unknown dataset impl {impl!r} for a builder; choose one of mmap, lazy, cached")


def make_dataset(path: PathLike, impl: str = "infer",
                 skip_warmup: bool = True) -> Union[MMapIndexedDataset, IndexedDataset, IndexedCachedDataset]:
    """Open ``path`` (a prefix without .bin/.idx) with impl 'mmap', 'lazy', 'cached' or 'infer'."""
    path = os.fspath(path)
    if impl not in ("infer", "mmap", "lazy", "cached"):
        raise ValueError(f"unknown --data-impl {impl!r}; choose one of infer, mmap, lazy, cached")
    if not _pair_exists(path):
        missing = [p for p in (index_file_path(path), data_file_path(path)) if not os.path.exists(p)]
        raise IndexedDatasetError(
            f"dataset {path} not found: missing {' and '.join(missing)}{missing_hint(path)}; check --data-path "
            "(a prefix without .bin/.idx) or run tools/preprocess_data.py"
        )
    if impl == "infer":
        impl = infer_dataset_impl(path)
    if impl in ("lazy", "cached"):
        return IndexedDataset(path) if impl == "lazy" else IndexedCachedDataset(path)
    return MMapIndexedDataset(path, skip_warmup)


def dataset_exists(path: PathLike, impl: str) -> bool:
    return _pair_exists(path)


def _pair_exists(path: PathLike) -> bool:
    return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))
