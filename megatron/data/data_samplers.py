"""Batch samplers and the data loader used for pretraining (Megatron's `--dataloader-type single|cyclic`).

Both samplers yield this data-parallel rank's micro-batch (a list of sample indices) and start from
`consumed_samples`, so a resumed run continues with exactly the batches it had not seen yet.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from megatron.process_guard import dataloader_worker_init


def _check(total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if total_samples <= 0:
        raise ValueError(f"no sample to consume: the dataset has {total_samples} samples")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be non-negative, got {consumed_samples}")
    if micro_batch_size <= 0 or dp_size <= 0:
        raise ValueError(f"--micro-batch-size ({micro_batch_size}) and data-parallel size ({dp_size}) must be positive")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} must be in [0, {dp_size})")


class MegatronPretrainingSampler:
    """Sequential: global batch k holds samples [consumed + k*mb*dp, ...); rank r takes its mb-sized slice."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, drop_last: bool = True) -> None:
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left to consume: consumed_samples={consumed_samples} but the dataset has "
                             f"{total_samples} samples (train for fewer samples, or build a larger dataset)")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self) -> tuple[int, int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        start, end = self.get_start_end_idx()
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                yield batch[start:end]
                batch = []
        if batch and not self.drop_last:
            yield batch[start:end]


class MegatronPretrainingRandomSampler:
    """Epoch-wise random order (torch.randperm seeded with the epoch number), resumable mid-epoch.

    With data_sharding each rank draws from its own contiguous bucket of the dataset; otherwise ranks interleave
    over one global permutation. A trailing partial global batch of each epoch is dropped.
    """

    def __init__(self, dataset: Any, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_sharding: bool = True) -> None:
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise ValueError(f"the dataset has {total_samples} samples, fewer than one global micro-batch "
                             f"({micro_batch_size} x {data_parallel_size} data-parallel ranks)")

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        active_total = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total
        current_epoch_samples = self.consumed_samples % active_total
        if current_epoch_samples % self.micro_batch_times_data_parallel_size != 0:
            raise ValueError(f"consumed_samples={self.consumed_samples} is not a whole number of global micro-batches "
                             f"({self.micro_batch_times_data_parallel_size} samples)")
        g = torch.Generator()
        g.manual_seed(self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start = self.data_parallel_rank * bucket_size
            idx_range = [start + x for x in torch.randperm(bucket_size, generator=g).tolist()[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            perm = torch.randperm(full_bucket_size, generator=g).tolist()[current_epoch_samples:]
            idx_range = perm[self.data_parallel_rank::self.data_parallel_size]
        batch: list[int] = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def build_pretraining_data_loader(dataset: Any, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                                  dp_size: int, num_workers: int = 2, dataloader_type: str = "single", *,
                                  data_sharding: bool = True, drop_last: bool = True,
                                  pin_memory: Optional[bool] = None) -> Optional[torch.utils.data.DataLoader]:
    """A torch DataLoader over `dataset` for this data-parallel rank, resuming after `consumed_samples`.

    Batches are collated dicts, e.g. {"text": LongTensor[micro_batch_size, seq_length + 1]}. None for no dataset.
    """
    if dataset is None:
        return None
    if dataloader_type == "single":
        sampler: Any = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size,
                                                  drop_last=drop_last)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(dataset, len(dataset), consumed_samples, micro_batch_size, dp_rank,
                                                   dp_size, data_sharding=data_sharding)
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r} is not supported; use 'single' or 'cyclic'")
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                                       persistent_workers=False,
                                       worker_init_fn=dataloader_worker_init if num_workers > 0 else None)
