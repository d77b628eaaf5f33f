"""BatchSettings: the batch shape, evaluation length and log cadence the training loop, its steps and its data
iterators read (megatron/training.py, megatron/backend/)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """Micro/global batch, data-parallel size, sequence lengths, --eval-iters, loaders and the log intervals."""

    settings: Settings = dataclasses.field(repr=False)
    data_parallel_size: int = 1  # validate_args
    world_size: int = 1  # the launcher's

    micro_batch_size = SettingValue(when_none=1)
    global_batch_size = SettingValue()
    seq_length = SettingValue()
    encoder_seq_length = SettingValue()
    decoder_seq_length = SettingValue()
    train_samples = SettingValue()
    eval_iters = SettingValue()
    num_workers = SettingValue()
    dataloader_type = SettingValue()
    log_interval = SettingValue()
    tensorboard_log_interval = SettingValue()
    bert_binary_head = SettingValue()

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> BatchSettings:
        return from_settings(cls, args, settings)
