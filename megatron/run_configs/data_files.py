"""DataFileSettings: the data flags megatron/data/data_checks.py checks before training starts."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

from megatron.run_configs.declared import fill_from_args

DATA_PATH_FLAGS = (("--data-path", "data_path"), ("--train-data-path", "train_data_path"),
                   ("--valid-data-path", "valid_data_path"), ("--test-data-path", "test_data_path"))


@dataclasses.dataclass(frozen=True)
class DataFileSettings:
    """The data paths (flag, entries incl. blend weights), --split, the run length and the padded vocabulary."""

    data_paths: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    split: str = "969, 30, 1"
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    skip_train: bool = False
    padded_vocab_size: Optional[int] = None

    def entries(self, attr: str) -> tuple[Any, ...]:
        return dict(self.data_paths).get(attr, ())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataFileSettings:
        return fill_from_args(
            cls, args,
            data_paths=tuple((attr, tuple(getattr(args, attr, None) or ())) for _, attr in DATA_PATH_FLAGS),
        )
