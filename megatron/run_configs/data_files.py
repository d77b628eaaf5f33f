"""DataFileSettings: the data flags megatron/data/data_checks.py checks before training starts."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

from megatron.run_configs.declared import SettingValue, flag_value, from_settings
from megatron.settings.values import Settings

DATA_PATH_FLAGS = (("--data-path", "data_path"), ("--train-data-path", "train_data_path"),
                   ("--valid-data-path", "valid_data_path"), ("--test-data-path", "test_data_path"))


@dataclasses.dataclass(frozen=True)
class DataFileSettings:
    """The data paths (flag, entries incl. blend weights), --split, the run length and the padded vocabulary."""

    settings: Settings = dataclasses.field(repr=False)
    data_paths: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    train_iters: Optional[int] = None  # the run's length (after set-up: RunConfigs.with_run_length)
    padded_vocab_size: Optional[int] = None

    split = SettingValue()
    train_samples = SettingValue()
    skip_train = SettingValue()
    sft = SettingValue()

    def entries(self, attr: str) -> tuple[Any, ...]:
        return dict(self.data_paths).get(attr, ())

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> DataFileSettings:
        return from_settings(
            cls, args, settings,
            data_paths=tuple((attr, tuple(getattr(args, attr, None) or ())) for _, attr in DATA_PATH_FLAGS),
            train_iters=flag_value(args, "train_iters"),
        )
