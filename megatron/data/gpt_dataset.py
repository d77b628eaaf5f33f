"""Megatron's GPT pretraining dataset: fixed-length samples cut from a shuffled stream of documents.

Index mappings (Megatron's algorithm, so caches and sample order carry over):
- doc_idx: the split's documents repeated for as many epochs as `num_samples` needs, shuffled with
  np.random.RandomState(seed); when the last epoch is used for less than 80% of its samples it is shuffled
  separately so its few samples do not all come from the front of the stream.
- sample_idx: start (position in doc_idx, token offset) of each sample of seq_length + 1 tokens (C++ helper).
- shuffle_idx: a permutation of the samples (again keeping the separate last epoch at the end).
They are cached as `<md5 of a description>_{doc,sample,shuffle}_idx.npy` (+ `.dsc`) in `--data-cache-path`, else
`<data dir>/index-cache`, else a user cache dir; rank 0 builds them while other ranks wait, then all load them
memory-mapped.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from megatron.data.dataset_builder import build_train_valid_test_splits
from megatron.data.dataset_utils import (
    barrier,
    file_lock,
    first_writable_dir,
    index_cache_dirs,
    is_group_leader,
    print_rank_0,
    save_npy_atomic,
    usable_npy,
    write_text_atomic,
)
from megatron.data.helpers import get_helpers

try:  # a torch Dataset when torch is present (it always is for training); plain object otherwise
    from torch.utils.data import Dataset as _TorchDataset
except ImportError:  # pragma: no cover
    _TorchDataset = object

_SUFFIXES = {"desc": ".dsc", "doc": "_doc_idx.npy", "sample": "_sample_idx.npy", "shuffle": "_shuffle_idx.npy"}


class GPTDataset(_TorchDataset):
    """Samples {"text": int64[seq_length + 1]} over `documents` (indices into indexed_dataset) of one split."""

    def __init__(self, name: str, data_prefix: str, documents: np.ndarray, indexed_dataset: Any, splits_string: str,
                 num_samples: int, seq_length: int, seed: int, return_doc_ids: bool = False, *,
                 data_cache_path: Optional[str] = None, group: Any = None, synchronize: bool = True) -> None:
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.return_doc_ids = return_doc_ids
        self.seq_length = seq_length
        documents = np.asarray(documents)
        num_docs = indexed_dataset.sizes.shape[0]
        if documents.size == 0 or documents.min() < 0 or documents.max() >= num_docs:
            raise ValueError(f"{data_prefix} ({name}): document indices must be a non-empty subset of [0, {num_docs})")
        if seq_length <= 0:
            raise ValueError(f"--seq-length must be positive, got {seq_length}")
        self.doc_idx, self.sample_idx, self.shuffle_idx, self.desc, self.desc_hash = _build_index_mappings(
            name, data_prefix, documents, indexed_dataset.sizes, splits_string, num_samples, seq_length, seed,
            data_cache_path=data_cache_path, group=group, synchronize=synchronize)

    def __len__(self) -> int:
        # sample i spans [sample_idx[i], sample_idx[i + 1]]
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx: int) -> dict:
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.name} GPTDataset of {len(self)} samples")
        idx = int(self.shuffle_idx[idx])
        doc_f, offset_f = (int(v) for v in self.sample_idx[idx])
        doc_l, offset_l = (int(v) for v in self.sample_idx[idx + 1])
        doc_ids = [int(self.doc_idx[i]) for i in range(doc_f, doc_l + 1)]
        if doc_f == doc_l:
            sample = self.indexed_dataset.get(doc_ids[0], offset=offset_f, length=offset_l - offset_f + 1)
        else:
            parts = [self.indexed_dataset.get(doc_ids[0], offset=offset_f)]
            parts += [self.indexed_dataset.get(d) for d in doc_ids[1:-1]]
            parts.append(self.indexed_dataset.get(doc_ids[-1], length=offset_l + 1))
            sample = np.concatenate(parts)
        out = {"text": np.array(sample, dtype=np.int64)}
        if self.return_doc_ids:  # for retrieval preprocessing, as Megatron
            out["doc_ids"] = np.array(doc_ids, dtype=np.int64)
        return out


def build_train_valid_test_datasets(data_prefix: Optional[Sequence[Any]], data_impl: str, splits_string: str,
                                    train_valid_test_num_samples: Sequence[int], seq_length: int, seed: int,
                                    skip_warmup: bool, data_cache_path: Optional[str] = None, *,
                                    train_data_prefix: Optional[Sequence[Any]] = None,
                                    valid_data_prefix: Optional[Sequence[Any]] = None,
                                    test_data_prefix: Optional[Sequence[Any]] = None,
                                    return_doc_ids: bool = False, group: Any = None,
                                    synchronize: bool = True) -> tuple:
    """(train, valid, test) datasets, each None when its split is empty.

    data_prefix: `--data-path` as a list: one prefix, or `w1 p1 w2 p2 ...` (blended). Without it,
    train/valid/test_data_prefix (`--train-data-path` ...) give separate, unsplit data per split.
    group: the ranks that call this together (default: all ranks); its lowest rank builds missing index caches
    while the others wait on a barrier. synchronize=False (for callers on a subset of ranks, e.g. only TP rank 0)
    uses no collectives: whichever process comes first builds under a file lock and the others wait on the lock.
    """

    def build_split(name: str, prefix: str, indexed: Any, documents: tuple, num_samples: int, splits: str):
        docs = np.arange(documents[0], documents[1], dtype=np.int32)
        return GPTDataset(name, prefix, docs, indexed, splits, num_samples, seq_length, seed, return_doc_ids,
                          data_cache_path=data_cache_path, group=group, synchronize=synchronize)

    return build_train_valid_test_splits(data_prefix, data_impl, splits_string, train_valid_test_num_samples,
                                         skip_warmup, build_split, train_data_prefix=train_data_prefix,
                                         valid_data_prefix=valid_data_prefix, test_data_prefix=test_data_prefix)


def _num_tokens(documents: np.ndarray, sizes: np.ndarray) -> int:
    return int(np.sum(sizes[documents], dtype=np.int64))


def _num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest number of epochs whose tokens give num_samples samples (one shared token between samples)."""
    num_epochs, total = 0, 0
    while True:
        num_epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return num_epochs


def _build_doc_idx(documents: np.ndarray, num_epochs: int, np_rng: np.random.RandomState,
                   separate_last_epoch: bool) -> np.ndarray:
    if not separate_last_epoch or num_epochs == 1:
        dtype = np.int32 if len(documents) * num_epochs < np.iinfo(np.int32).max else np.int64
        doc_idx = np.tile(np.asarray(documents, dtype=dtype), num_epochs)
        np_rng.shuffle(doc_idx)
        return doc_idx
    first = _build_doc_idx(documents, num_epochs - 1, np_rng, False)
    last = _build_doc_idx(documents, 1, np_rng, False)
    return np.concatenate((first, last.astype(first.dtype)))


def _build_shuffle_idx(num_samples: int, total_size: int, np_rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, num_samples, dtype=dtype)
    np_rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    np_rng.shuffle(last)
    return np.concatenate((first, last))


def _describe(name: str, data_prefix: str, num_samples: int, seq_length: int, seed: int, splits_string: str) -> str:
    return (f"GPT Dataset\n\nData prefix {data_prefix}\nDataset name {name}\nNumber of samples {num_samples}\n"
            f"Sequence length {seq_length}\nRandom seed {seed}\nSplit {splits_string}\n")


def _find_cache(search_dirs: Sequence[Path], desc_hash: str, report: bool = False) -> Optional[dict]:
    """The first complete, intact cache entry (a damaged .npy is skipped, named when `report`, and rebuilt)."""
    for d in search_dirs:
        paths = {k: d / (desc_hash + s) for k, s in _SUFFIXES.items()}
        if all(p.is_file() for p in paths.values()) and \
                all(usable_npy(p, report) for k, p in paths.items() if k != "desc"):
            return paths
    return None


def _build_and_save(dirs: Sequence[Path], search_dirs: Sequence[Path], desc: str, desc_hash: str,
                    documents: np.ndarray, sizes: np.ndarray,
                    num_samples: int, seq_length: int, seed: int, tokens_per_epoch: int, num_epochs: int,
                    data_cache_path: Optional[str] = None) -> None:
    """Build the three index arrays and write them (under a file lock, so concurrent builders do it once)."""
    out_dir = first_writable_dir(dirs, data_cache_path=data_cache_path)
    with file_lock(out_dir / f".{desc_hash}.lock"):
        if _find_cache(search_dirs, desc_hash, report=True) is None:
            _build_arrays_into(out_dir, desc, desc_hash, documents, sizes, num_samples, seq_length, seed,
                               tokens_per_epoch, num_epochs)


def _build_arrays_into(out_dir: Path, desc: str, desc_hash: str, documents: np.ndarray, sizes: np.ndarray,
                       num_samples: int, seq_length: int, seed: int, tokens_per_epoch: int, num_epochs: int) -> None:
    print(" > WARNING: could not find index map files, building the indices on rank 0 ...", flush=True)
    np_rng = np.random.RandomState(seed=seed)
    if num_epochs == 1:
        separate_last_epoch = False
        print(" > only one epoch required, setting separate_last_epoch to False", flush=True)
    else:
        from_epochs_minus_one = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_epoch_num_samples = num_samples - from_epochs_minus_one
        per_epoch = (tokens_per_epoch - 1) // seq_length
        assert 0 <= last_epoch_num_samples <= per_epoch + 1, "last epoch sample count out of range"
        separate_last_epoch = last_epoch_num_samples < int(0.80 * per_epoch)
        verdict = "smaller than" if separate_last_epoch else "larger than"
        print(f" > last epoch number of samples ({last_epoch_num_samples}) is {verdict} 80% of number of samples "
              f"per epoch ({per_epoch}), setting separate_last_epoch to {separate_last_epoch}", flush=True)

    paths = {k: out_dir / (desc_hash + s) for k, s in _SUFFIXES.items()}
    start = time.time()
    doc_idx = _build_doc_idx(documents, num_epochs, np_rng, separate_last_epoch)
    save_npy_atomic(paths["doc"], doc_idx)
    print(f" > elapsed time to build and save doc-idx mapping (seconds): {time.time() - start:4f}", flush=True)

    start = time.time()
    sizes32 = np.ascontiguousarray(sizes, dtype=np.int32)
    sample_idx = get_helpers().build_sample_idx(sizes32, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    save_npy_atomic(paths["sample"], sample_idx)
    print(f" > elapsed time to build and save sample-idx mapping (seconds): {time.time() - start:4f}", flush=True)

    start = time.time()
    total = sample_idx.shape[0] - 1
    first_part = from_epochs_minus_one if separate_last_epoch else total
    shuffle_idx = _build_shuffle_idx(first_part, total, np_rng)
    save_npy_atomic(paths["shuffle"], shuffle_idx)
    print(f" > elapsed time to build and save shuffle-idx mapping (seconds): {time.time() - start:4f}", flush=True)
    write_text_atomic(paths["desc"], desc)  # written last: marks a complete cache entry


def _build_index_mappings(name: str, data_prefix: str, documents: np.ndarray, sizes: np.ndarray, splits_string: str,
                          num_samples: int, seq_length: int, seed: int, *, data_cache_path: Optional[str] = None,
                          group: Any = None, synchronize: bool = True) -> tuple:
    """Load or build (doc_idx, sample_idx, shuffle_idx) for one split; returns them with desc and its hash."""
    tokens_per_epoch = _num_tokens(documents, sizes)
    if tokens_per_epoch < 2:
        raise ValueError(f"{data_prefix} ({name} split): its documents hold {tokens_per_epoch} tokens; at least 2 are "
                         "needed to make a sample (use more data or a different --split)")
    num_epochs = _num_epochs(tokens_per_epoch, seq_length, num_samples)
    desc = _describe(name, data_prefix, num_samples, seq_length, seed, splits_string)
    desc_hash = hashlib.md5(desc.encode("utf-8")).hexdigest()
    dirs = index_cache_dirs(data_prefix, data_cache_path)
    search_dirs = index_cache_dirs(data_prefix, data_cache_path, for_search=True)

    def build() -> None:
        _build_and_save(dirs, search_dirs, desc, desc_hash, documents, sizes, num_samples, seq_length, seed,
                        tokens_per_epoch, num_epochs, data_cache_path)

    error: Optional[BaseException] = None
    if synchronize:
        if _find_cache(search_dirs, desc_hash) is None and is_group_leader(group):
            try:
                build()
            except BaseException as exc:  # noqa: BLE001 - reach the barrier first so other ranks do not hang
                error = exc
        barrier(group)
        if error is not None:
            raise error
    paths = _find_cache(search_dirs, desc_hash)
    if paths is None:  # not visible here (e.g. node-local disk): the build is deterministic, so redo it locally
        build()
        paths = _find_cache(search_dirs, desc_hash)
        if paths is None:
            raise RuntimeError(f"index cache for {data_prefix} ({name}) was built but cannot be found in "
                               f"{', '.join(map(str, dirs))}")

    start = time.time()
    print_rank_0(f" > loading doc-idx mapping from {paths['doc']}")
    doc_idx = np.load(paths["doc"], allow_pickle=False, mmap_mode="r")
    print_rank_0(f" > loading sample-idx mapping from {paths['sample']}")
    sample_idx = np.load(paths["sample"], allow_pickle=False, mmap_mode="r")
    print_rank_0(f" > loading shuffle-idx mapping from {paths['shuffle']}")
    shuffle_idx = np.load(paths["shuffle"], allow_pickle=False, mmap_mode="r")
    print_rank_0(f"    loaded indexed file in {time.time() - start:3.3f} seconds")
    print_rank_0(f"    total number of samples: {sample_idx.shape[0]}")
    print_rank_0(f"    total number of epochs: {num_epochs}")
    return doc_idx, sample_idx, shuffle_idx, desc, desc_hash
