"""A weighted blend of several datasets (Megatron's BlendableDataset).

Sample i of the blend comes from dataset `dataset_index[i]`, as that dataset's `dataset_sample_index[i]`-th
sample; the C++ helper assigns each position greedily to the dataset furthest below its weighted share, so every
prefix of the blend follows the weights closely.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from megatron.data.dataset_utils import is_rank_0, print_rank_0
from megatron.data.helpers import get_helpers

try:
    from torch.utils.data import Dataset as _TorchDataset
except ImportError:  # pragma: no cover
    _TorchDataset = object


class BlendableDataset(_TorchDataset):
    """`size` samples drawn from `datasets` in proportion to `weights` (normalised here)."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: int) -> None:
        self.datasets = list(datasets)
        num_datasets = len(self.datasets)
        if num_datasets == 0 or num_datasets != len(weights):
            raise ValueError(f"BlendableDataset: got {num_datasets} datasets and {len(weights)} weights")
        if num_datasets > 255:
            raise ValueError(f"BlendableDataset: at most 255 datasets can be blended, got {num_datasets}")
        w = np.array(weights, dtype=np.float64)
        if np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"BlendableDataset: weights must be non-negative with a positive sum, got {list(weights)}")
        self.weights = w / w.sum()
        self.size = int(size)

        start = time.time()
        self.dataset_index = np.zeros(self.size, dtype=np.uint8)
        self.dataset_sample_index = np.zeros(self.size, dtype=np.int64)
        get_helpers().build_blending_indices(self.dataset_index, self.dataset_sample_index, self.weights,
                                             num_datasets, self.size, is_rank_0())
        print_rank_0(f"> elapsed time for building blendable dataset indices: {time.time() - start:.2f} (sec)")

        for d, ds in enumerate(self.datasets):  # fail now, not mid-training, if a component is too small
            needed = int(np.count_nonzero(self.dataset_index == d))
            if needed > len(ds):
                raise ValueError(f"BlendableDataset: dataset {d} has {len(ds)} samples but the blend needs {needed}")
        self.desc = "Blendable dataset\n\nDatasets:\n" + "".join(
            getattr(ds, "desc", type(ds).__name__) + "\n\n" for ds in self.datasets)
        self.desc += f"Weights: {self.weights}\nSize: {self.size}\n"
        print_rank_0(f"> size of blendable dataset: {self.size} samples")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Any:
        if idx < 0:
            idx += self.size
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
