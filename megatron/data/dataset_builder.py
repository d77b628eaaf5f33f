"""One train/valid/test builder for every pretraining dataset (GPT, BERT, T5): `--split`, blending, separate paths.

Megatron semantics, shared by all model families:
- `--data-path PREFIX` with `--split 969,30,1`: the split is applied to documents and each non-empty part becomes a
  dataset of that split;
- `--data-path w1 p1 w2 p2 ...`: every prefix is split the same way and asked for its share of the samples plus
  0.5%, and each split is a `BlendableDataset` of the parts;
- `--train-data-path` / `--valid-data-path` / `--test-data-path`: separate (optionally weighted) data per split,
  each prefix used whole.
A model family only says how to make one split's dataset: `build_split(name, data_prefix, indexed_dataset,
(first_doc, end_doc), num_samples, splits_string)` returning the dataset (or None to leave that split empty).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import (
    get_datasets_weights_and_num_samples,
    get_indexed_dataset_,
    get_train_valid_test_split_,
    print_rank_0,
)

SplitBuilder = Callable[[str, str, Any, tuple, int, str], Any]
SPLIT_NAMES = ("train", "valid", "test")


def build_train_valid_test_splits(data_prefix: Optional[Sequence[Any]], data_impl: str, splits_string: str,
                                  train_valid_test_num_samples: Sequence[int], skip_warmup: bool,
                                  build_split: SplitBuilder, *, split_documents: bool = False,
                                  train_data_prefix: Optional[Sequence[Any]] = None,
                                  valid_data_prefix: Optional[Sequence[Any]] = None,
                                  test_data_prefix: Optional[Sequence[Any]] = None) -> tuple:
    """(train, valid, test) datasets, each None when its split is empty.

    split_documents: split on the documents of `doc_idx` (sentence-level data: BERT, T5) instead of on the items
    (GPT: one item per document), as the Megatron builder of each family does.
    """
    if isinstance(data_prefix, (str, Path)):
        data_prefix = [str(data_prefix)]
    nums = [int(n) for n in train_valid_test_num_samples]
    if len(nums) != 3 or any(n < 0 for n in nums):
        raise ValueError(f"train_valid_test_num_samples must be three non-negative counts, got {nums}")
    common = dict(data_impl=data_impl, skip_warmup=skip_warmup, build_split=build_split,
                  split_documents=split_documents)
    if data_prefix:
        if len(data_prefix) == 1:
            return _build_single_prefix(str(data_prefix[0]), splits_string=splits_string, num_samples=nums, **common)
        prefixes, weights, per_dataset = get_datasets_weights_and_num_samples(data_prefix, nums)
        parts = [_build_single_prefix(p, splits_string=splits_string, num_samples=n, **common)
                 for p, n in zip(prefixes, per_dataset)]
        blended = []
        for split in range(3):
            members = [(ds[split], w) for ds, w in zip(parts, weights) if ds[split] is not None]
            if not members or nums[split] == 0:
                blended.append(None)
                continue
            blended.append(BlendableDataset([m[0] for m in members], [m[1] for m in members], nums[split]))
        return tuple(blended)
    if not (train_data_prefix or valid_data_prefix or test_data_prefix):
        raise ValueError("no training data: pass --data-path, or --train-data-path/--valid-data-path/--test-data-path")
    return tuple(_build_separate(name, prefix, n, **common)
                 for name, prefix, n in zip(SPLIT_NAMES, (train_data_prefix, valid_data_prefix, test_data_prefix),
                                            nums))


def _build_single_prefix(data_prefix: str, *, data_impl: str, splits_string: str, num_samples: Sequence[int],
                         skip_warmup: bool, build_split: SplitBuilder, split_documents: bool) -> tuple:
    indexed = get_indexed_dataset_(data_prefix, data_impl, skip_warmup)
    total = indexed.doc_idx.shape[0] - 1 if split_documents else indexed.sizes.shape[0]
    splits = get_train_valid_test_split_(splits_string, total)
    print_rank_0(" > dataset split:")
    for i, label in enumerate(("train", "validation", "test")):
        print_rank_0(f"    {label}:")
        print_rank_0(f"     document indices in [{splits[i]}, {splits[i + 1]}) total of "
                     f"{splits[i + 1] - splits[i]} documents")
        if split_documents:
            first, end = int(indexed.doc_idx[splits[i]]), int(indexed.doc_idx[splits[i + 1]])
            print_rank_0(f"     sentence indices in [{first}, {end}) total of {end - first} sentences")
    datasets = []
    for i, name in enumerate(SPLIT_NAMES):
        if splits[i + 1] <= splits[i]:
            datasets.append(None)
            continue
        datasets.append(build_split(name, data_prefix, indexed, (splits[i], splits[i + 1]), num_samples[i],
                                    splits_string))
    return tuple(datasets)


def _build_separate(name: str, data_prefix: Optional[Sequence[Any]], num_samples: int, **common) -> Any:
    """One split from its own `--{name}-data-path` (single or weighted list), using all of its documents."""
    if not data_prefix:
        return None
    if isinstance(data_prefix, (str, Path)):
        data_prefix = [str(data_prefix)]
    index = SPLIT_NAMES.index(name)

    def one(prefix: str, n: int):
        counts = [0, 0, 0]
        counts[index] = n
        splits = ["0", "0", "0"]
        splits[index] = "1"
        return _build_single_prefix(prefix, splits_string=",".join(splits), num_samples=counts, **common)[index]

    if len(data_prefix) == 1:
        return one(str(data_prefix[0]), num_samples)
    prefixes, weights, per_dataset = get_datasets_weights_and_num_samples(data_prefix, num_samples)
    members = [(one(p, n), w) for p, n, w in zip(prefixes, per_dataset, weights)]
    members = [(ds, w) for ds, w in members if ds is not None]
    if not members:
        return None
    return BlendableDataset([m[0] for m in members], [m[1] for m in members], num_samples)


@contextlib.contextmanager
def documents_view(indexed_dataset: Any, documents: tuple) -> Iterator[Any]:
    """Temporarily narrow `indexed_dataset.doc_idx` to documents [first, end) (sentence indices stay absolute), as
    Megatron's BERT/T5 builders do while a split's samples mapping is made; restored afterwards."""
    first, end = documents
    if hasattr(indexed_dataset, "set_doc_idx"):
        full = indexed_dataset.get_doc_idx()
        set_doc_idx = indexed_dataset.set_doc_idx
    else:  # the legacy (lazy/cached) readers keep doc_idx as a plain attribute
        full = indexed_dataset.doc_idx

        def set_doc_idx(value: np.ndarray) -> None:
            indexed_dataset.doc_idx = value
    set_doc_idx(np.asarray(full)[first:end + 1])
    try:
        yield indexed_dataset
    finally:
        set_doc_idx(full)
