"""BatchSettings: the batch shape, evaluation length and log cadence the training loop, its steps and its data
iterators read (megatron/training.py, megatron/backend/)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional


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
        return cls(
            micro_batch_size=args.micro_batch_size,
            global_batch_size=getattr(args, "global_batch_size", None),
            data_parallel_size=getattr(args, "data_parallel_size", 1),
            seq_length=getattr(args, "seq_length", None),
            encoder_seq_length=getattr(args, "encoder_seq_length", None),
            decoder_seq_length=getattr(args, "decoder_seq_length", None),
            train_samples=getattr(args, "train_samples", None),
            eval_iters=getattr(args, "eval_iters", 100),
            num_workers=getattr(args, "num_workers", 2),
            dataloader_type=getattr(args, "dataloader_type", None),
            log_interval=getattr(args, "log_interval", 100),
            tensorboard_log_interval=getattr(args, "tensorboard_log_interval", 1),
            world_size=getattr(args, "world_size", 1),
            bert_binary_head=bool(getattr(args, "bert_binary_head", True)),
        )
