"""BatchSettings: the batch shape, evaluation length and log cadence the training loop, its steps and its data
iterators read (megatron/training.py, megatron/backend/)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """Micro/global batch, data-parallel size, sequence lengths, --eval-iters, loaders and the log intervals."""

    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    data_parallel_size: int = 1
    seq_length: Optional[int] = None
    encoder_seq_length: Optional[int] = None
    decoder_seq_length: Optional[int] = None
    train_samples: Optional[int] = None
    eval_iters: int = 100
    num_workers: int = 2
    dataloader_type: Optional[str] = None
    log_interval: int = 100
    tensorboard_log_interval: int = 1
    world_size: int = 1
    bert_binary_head: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchSettings:
        return fill_from_args(cls, args)
