"""Megatron's legacy ``lazy``/``cached`` indexed dataset format (readers and builder).

``.idx`` layout (little-endian): magic ``TNTIDX\\x00\\x00`` (8 bytes), version u64 (= 1), dtype code u64, element
size u64, N u64 (items), S u64 (size entries), D u64 (doc_idx entries), then dim_offsets int64[N+1], data_offsets
int64[N+1] (in elements), sizes int64[S] and doc_idx int64[D]; ``.bin`` holds the raw elements. Items may be
n-dimensional (their shapes go to ``sizes``). The older layout without D and doc_idx is read too (one item per
document). Use it through :mod:`megatron.data.indexed_dataset` (``make_dataset(prefix, "lazy"|"cached")``).
"""
from __future__ import annotations

import os
import shutil
import struct
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from megatron.data.index_format import (
    COPY_CHUNK,
    DTYPES,
    LEGACY_MAGIC,
    MMAP_MAGIC,
    RERUN_HINT,
    IndexedDatasetError,
    PathLike,
    check_doc_idx,
    checked_file_size,
    code,
    data_file_path,
    index_file_path,
    little_endian,
    temporary_path,
    to_numpy,
)

_LEGACY_HEADER = struct.Struct("<8sQQQQQ")  # magic, version, dtype code, element size, N, S  (48 bytes)
_LEGACY_DOC_COUNT = struct.Struct("<Q")  # D, present in Megatron's layout (absent in the older fairseq one)


def read_longs(f: Any, n: int) -> np.ndarray:
    a = np.empty(int(n), dtype="<i8")
    if f.readinto(a) != a.nbytes:
        raise IndexedDatasetError(f"{getattr(f, 'name', 'index')}: unexpected end of file; {RERUN_HINT}")
    return a


def write_longs(f: Any, a: Iterable[int]) -> None:
    f.write(np.asarray(a, dtype="<i8").tobytes(order="C"))


def legacy_index_size(num_items: int, num_sizes: int, num_doc_idx: int) -> int:
    """Size in bytes of a legacy .idx file: 56 + 8 (2 (N + 1) + S + D)."""
    return _LEGACY_HEADER.size + 8 + 8 * (2 * (num_items + 1) + num_sizes + num_doc_idx)


class IndexedDataset:
    """Legacy ``lazy`` reader: the index is loaded into memory, items are read from the .bin on demand."""

    _HDR_MAGIC = LEGACY_MAGIC

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        self.data_file = None
        self.read_index(self.path)

    def read_index(self, path: str) -> None:
        idx_path = index_file_path(path)
        file_size = checked_file_size(idx_path, path)
        if file_size < _LEGACY_HEADER.size:
            raise IndexedDatasetError(
                f"{idx_path} is {file_size} bytes, shorter than the {_LEGACY_HEADER.size}-byte legacy index header; "
                f"the index is truncated; {RERUN_HINT}"
            )
        with open(idx_path, "rb") as f:
            magic, version, dtype_code, element_size, n, s = _LEGACY_HEADER.unpack(f.read(_LEGACY_HEADER.size))
            if magic != LEGACY_MAGIC:
                if magic == MMAP_MAGIC[:8]:
                    raise IndexedDatasetError(f"{idx_path} is an mmap index, not lazy/cached; use --data-impl mmap or infer")
                raise IndexedDatasetError(
                    f"{idx_path} is not a legacy index: magic {magic!r} != {LEGACY_MAGIC!r}; wrong file or corrupt; "
                    f"{RERUN_HINT}"
                )
            if version != 1:
                raise IndexedDatasetError(f"{idx_path}: unsupported legacy index version {version} (expected 1); {RERUN_HINT}")
            if dtype_code not in DTYPES:
                raise IndexedDatasetError(
                    f"{idx_path}: unknown dtype code {dtype_code} in the header (valid codes 1..8); the index is "
                    f"corrupt; {RERUN_HINT}"
                )
            self.dtype = little_endian(DTYPES[dtype_code])
            if element_size != self.dtype.itemsize:
                raise IndexedDatasetError(
                    f"{idx_path}: element size {element_size} does not match dtype {self.dtype.name} "
                    f"({self.dtype.itemsize} bytes); the index is corrupt; {RERUN_HINT}"
                )
            self.element_size = element_size
            self._len, self.s = n, s
            old_layout = _LEGACY_HEADER.size + 8 * (2 * (n + 1) + s)
            d = None
            if file_size >= _LEGACY_HEADER.size + 8:
                (d,) = _LEGACY_DOC_COUNT.unpack(f.read(8))
            if d is not None and file_size == legacy_index_size(n, s, d):
                self.doc_count = d
            elif file_size == old_layout:  # pre-doc_idx layout: every item is its own document
                f.seek(_LEGACY_HEADER.size)
                self.doc_count = None
            else:
                shown = legacy_index_size(n, s, d) if d is not None else old_layout
                raise IndexedDatasetError(
                    f"{idx_path} is {file_size} bytes but its header promises {n} items, {s} sizes and {d} doc_idx "
                    f"entries = {shown} bytes; the index is truncated or corrupt; {RERUN_HINT}"
                )
            self.dim_offsets = read_longs(f, n + 1)
            self.data_offsets = read_longs(f, n + 1)
            self.sizes = read_longs(f, s)
            if self.doc_count is None:
                self.doc_idx = np.arange(n + 1, dtype=np.int64)
                self.doc_count = n + 1
            else:
                self.doc_idx = read_longs(f, self.doc_count)
        self._validate(idx_path)

    def _validate(self, idx_path: str) -> None:
        for name, offsets, last in (("dim_offsets", self.dim_offsets, self.s), ("data_offsets", self.data_offsets, None)):
            steps = np.diff(offsets)
            if offsets[0] != 0 or (len(steps) and steps.min() < 0) or (last is not None and offsets[-1] != last):
                raise IndexedDatasetError(
                    f"{idx_path}: {name} must start at 0, never decrease and end at the number of sizes; the index "
                    f"is corrupt; {RERUN_HINT}"
                )
        if len(self.sizes) and self.sizes.min() < 0:
            raise IndexedDatasetError(f"{idx_path}: negative sizes; the index is corrupt; {RERUN_HINT}")
        counts = np.diff(self.data_offsets)
        if np.array_equal(self.dim_offsets, np.arange(self._len + 1)):  # 1-D items: one size each
            ok = np.array_equal(counts, self.sizes)
        else:
            ok = all(
                int(np.prod(self.sizes[self.dim_offsets[i]:self.dim_offsets[i + 1]])) == counts[i] for i in range(self._len)
            )
        if not ok:
            raise IndexedDatasetError(f"{idx_path}: data_offsets disagree with sizes; the index is corrupt; {RERUN_HINT}")
        check_doc_idx(self.doc_idx, self.s, idx_path)
        bin_path = data_file_path(self.path)
        bin_size = checked_file_size(bin_path, self.path)
        expected = int(self.data_offsets[-1]) * self.element_size
        if bin_size != expected:
            state = "truncated" if bin_size < expected else "too long"
            raise IndexedDatasetError(
                f"{bin_path} holds {bin_size} bytes but {idx_path} promises {expected} = {int(self.data_offsets[-1])} "
                f"elements x {self.element_size} bytes; the .bin is {state} or belongs to another index; {RERUN_HINT}"
            )

    def read_data(self, path: str) -> None:
        self.data_file = open(data_file_path(path), "rb", buffering=0)

    def check_index(self, i: int) -> int:
        if not -self._len <= i < self._len:
            raise IndexError(f"item index {i} out of range for {self.path} with {self._len} items")
        return i % self._len if self._len else i

    def _shape(self, i: int) -> tuple[int, ...]:
        return tuple(int(x) for x in self.sizes[self.dim_offsets[i]:self.dim_offsets[i + 1]])

    def _read(self, out: np.ndarray, element_offset: int) -> np.ndarray:
        if not self.data_file:
            self.read_data(self.path)
        self.data_file.seek(element_offset * self.element_size)
        if out.nbytes and self.data_file.readinto(out) != out.nbytes:
            raise IndexedDatasetError(f"{data_file_path(self.path)}: unexpected end of file; {RERUN_HINT}")
        return out

    def __del__(self) -> None:
        if getattr(self, "data_file", None):
            self.data_file.close()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["data_file"] = None
        return state

    def __getitem__(self, idx: Union[int, slice]) -> Union[np.ndarray, list[np.ndarray]]:
        if isinstance(idx, (int, np.integer)):
            i = self.check_index(int(idx))
            return self._read(np.empty(self._shape(i), dtype=self.dtype), int(self.data_offsets[i]))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices into an indexed dataset must be contiguous (step 1), got step {step}")
            if start >= stop:
                return []
            begin = int(self.data_offsets[start])
            flat = self._read(np.empty(int(self.data_offsets[stop]) - begin, dtype=self.dtype), begin)
            return [
                flat[int(self.data_offsets[i]) - begin:int(self.data_offsets[i + 1]) - begin].reshape(self._shape(i))
                for i in range(start, stop)
            ]
        raise TypeError(f"indexed datasets are indexed by int or slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Elements ``[offset, offset + length)`` of (flattened) item ``idx``."""
        i = self.check_index(int(idx))
        size = int(self.data_offsets[i + 1] - self.data_offsets[i])
        length = size - offset if length is None else int(length)
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"get({idx}, offset={offset}, length={length}) is outside item {idx} of {self.path} ({size})")
        return self._read(np.empty(length, dtype=self.dtype), int(self.data_offsets[i]) + offset)

    def __len__(self) -> int:
        return self._len

    def num_tokens(self, index: int) -> int:
        return int(self.sizes[index])

    def size(self, index: int) -> int:
        return int(self.sizes[index])

    @staticmethod
    def exists(path: PathLike) -> bool:
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))

    @property
    def supports_prefetch(self) -> bool:
        return False


class IndexedCachedDataset(IndexedDataset):
    """Legacy ``cached`` reader: ``prefetch(indices)`` loads items into memory; others are read from disk."""

    def __init__(self, path: PathLike) -> None:
        super().__init__(path)
        self.cache: Optional[np.ndarray] = None
        self.cache_index: dict[int, int] = {}

    @property
    def supports_prefetch(self) -> bool:
        return True

    def prefetch(self, indices: Iterable[int]) -> None:
        indices = sorted({self.check_index(int(i)) for i in indices})
        if all(i in self.cache_index for i in indices):
            return
        total = sum(int(self.data_offsets[i + 1] - self.data_offsets[i]) for i in indices)
        self.cache = np.empty(total, dtype=self.dtype)
        self.cache_index = {}
        ptx = 0
        for i in indices:
            size = int(self.data_offsets[i + 1] - self.data_offsets[i])
            self._read(self.cache[ptx:ptx + size], int(self.data_offsets[i]))
            self.cache_index[i] = ptx
            ptx += size
        if self.data_file:
            self.data_file.close()
            self.data_file = None

    def __getitem__(self, idx: Union[int, slice]) -> Union[np.ndarray, list[np.ndarray]]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices into an indexed dataset must be contiguous (step 1), got step {step}")
            return [self[i] for i in range(start, stop)]
        i = self.check_index(int(idx))
        if i not in self.cache_index:
            return super().__getitem__(i)
        ptx = self.cache_index[i]
        size = int(self.data_offsets[i + 1] - self.data_offsets[i])
        return self.cache[ptx:ptx + size].reshape(self._shape(i)).copy()


class IndexedDatasetBuilder:
    """Writes a legacy lazy/cached pair (items may be n-dimensional; their shapes go to ``sizes``)."""

    def __init__(self, out_file: PathLike, dtype: Any = np.int32) -> None:
        self._out_path = os.fspath(out_file)
        self.dtype = little_endian(dtype)
        self._tmp_bin = temporary_path(self._out_path)
        self.out_file = open(self._tmp_bin, "wb")
        self.data_offsets = [0]
        self.dim_offsets = [0]
        self.sizes: list[int] = []
        self.element_size = self.dtype.itemsize
        self.doc_idx = [0]
        self._finalized = False

    def add_item(self, tensor: Any) -> None:
        arr = to_numpy(tensor, self.dtype, self._out_path)
        self.out_file.write(arr.reshape(-1))
        self.data_offsets.append(self.data_offsets[-1] + arr.size)
        self.sizes.extend(arr.shape)
        self.dim_offsets.append(self.dim_offsets[-1] + arr.ndim)

    def add_doc(self, tokens: Any, lengths: Sequence[int]) -> None:
        arr = to_numpy(tokens, self.dtype, self._out_path).reshape(-1)
        lengths = lengths.tolist() if hasattr(lengths, "tolist") else list(lengths)  # numpy / torch / list
        if sum(lengths) != arr.size:
            raise IndexedDatasetError(
                f"{self._out_path}: add_doc got {arr.size} tokens but sentence lengths summing to {sum(lengths)}"
            )
        start = 0
        for n in lengths:
            self.add_item(arr[start:start + n])
            start += n
        self.end_document()

    def end_document(self) -> None:
        self.doc_idx.append(len(self.sizes))

    def merge_file_(self, another_file: PathLike) -> None:
        prefix = os.fspath(another_file)
        index = IndexedDataset(prefix)
        if index.dtype != self.dtype:
            raise IndexedDatasetError(
                f"cannot merge {prefix}: its items are {index.dtype.name} but {self._out_path} holds "
                f"{self.dtype.name}; build every part with the same dtype"
            )
        doc_offset = len(self.sizes)
        begin = self.data_offsets[-1]
        self.data_offsets.extend((begin + index.data_offsets[1:]).tolist())
        self.sizes.extend(index.sizes.tolist())
        begin = self.dim_offsets[-1]
        self.dim_offsets.extend((begin + index.dim_offsets[1:]).tolist())
        self.doc_idx.extend((doc_offset + index.doc_idx[1:]).tolist())
        with open(data_file_path(prefix), "rb") as stream:
            shutil.copyfileobj(stream, self.out_file, COPY_CHUNK)

    def abort(self) -> None:
        """Close and delete the temporary files without producing a dataset."""
        if not self._finalized:
            self.out_file.close()
            if os.path.exists(self._tmp_bin):
                os.remove(self._tmp_bin)
            self._finalized = True

    def finalize(self, index_file: PathLike) -> None:
        if self._finalized:
            raise RuntimeError(f"builder for {self._out_path} was already finalized or aborted")
        self._finalized = True
        self.out_file.close()
        index_file = os.fspath(index_file)
        tmp_idx = temporary_path(index_file)
        try:
            with open(tmp_idx, "wb") as index:
                index.write(_LEGACY_HEADER.pack(LEGACY_MAGIC, 1, code(self.dtype), self.element_size,
                                                len(self.data_offsets) - 1, len(self.sizes)))
                index.write(_LEGACY_DOC_COUNT.pack(len(self.doc_idx)))
                write_longs(index, self.dim_offsets)
                write_longs(index, self.data_offsets)
                write_longs(index, self.sizes)
                write_longs(index, self.doc_idx)
            os.replace(self._tmp_bin, self._out_path)
            os.replace(tmp_idx, index_file)
        except BaseException:
            for p in (self._tmp_bin, tmp_idx):
                if os.path.exists(p):
                    os.remove(p)
            raise
