"""RunConfigs: one run's typed records together, built once from the parsed flags and passed down explicitly.

`pretrain()` (megatron/training.py) builds one `RunConfigs` after start-up and hands it, with the `TrainingState`, to
the loop, the training backends (megatron/backend/), the model set-up and the checkpoint code, which read the record
they need (``configs.checkpoint``, ``configs.step``, ...) instead of ``args``. Megatron's public functions that take
no records (``save_checkpoint(iteration, model, optimizer, opt_param_scheduler)``, ``load_checkpoint(...)``,
``get_model(...)``) stay thin wrappers: they build the record they need from the flags and call the typed core.

``settings`` holds the settings groups instantiated once from the flags (megatron/settings/values.py); every record
reads its settings from it and holds only derived values. ``flags`` is the parsed namespace itself, for what is the
namespace by nature (the ``args`` record a checkpoint stores for Megatron's tools; ``model_type`` and ``iteration``,
which Megatron records on it) and for the code not converted yet. Read a record, not ``flags``, where there is one:
tests/test_run_configs_built_once.py caps the reads.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

from megatron.run_configs.architecture import architecture_from_args
from megatron.run_configs.batch import BatchSettings
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.run_configs.data_files import DataFileSettings
from megatron.run_configs.deepspeed import DeepSpeedSettings
from megatron.run_configs.log_settings import LogSettings
from megatron.run_configs.memory import MemorySettings
from megatron.run_configs.model_wrap import ModelWrapSettings
from megatron.run_configs.run_settings import LoopSettings
from megatron.run_configs.schedule import ScheduleSettings
from megatron.run_configs.step import StepSettings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class RunConfigs:
    """The records of one run (see the module docstring)."""

    settings: Settings = dataclasses.field(repr=False)  # the settings groups' values (the records read them)
    checkpoint: CheckpointSettings
    deepspeed: DeepSpeedSettings
    step: StepSettings
    model_wrap: ModelWrapSettings
    log: LogSettings
    memory: MemorySettings
    loop: LoopSettings
    batch: BatchSettings
    data_files: DataFileSettings
    schedule: ScheduleSettings  # the LR / weight-decay schedule (the flags as parsed: before --train-samples
    # becomes --train-iters, which `with_run_length` picks up)
    architecture: Mapping[str, Any]  # the checkpoint's ``architecture`` record of this run (checked on load)
    transformer: Any  # the model's TransformerConfig (the FLOPs of the log line, the fused-kernels line)
    optimizer: Any  # the OptimizerConfig (megatron/optimizer/optimizer_config.py)
    flags: argparse.Namespace = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace, load_arg: str = "load") -> RunConfigs:
        """All records from validated flags (`load_arg`: the flag naming the folder checkpoints load from)."""
        from megatron.arguments import core_transformer_config_from_args
        from megatron.optimizer.optimizer_config import optimizer_config_from_args

        settings = Settings.from_args(args)
        return cls(
            settings=settings, checkpoint=CheckpointSettings.from_args(args, load_arg, settings=settings),
            deepspeed=DeepSpeedSettings.from_args(args, settings), step=StepSettings.from_args(args, settings),
            model_wrap=ModelWrapSettings.from_args(args, settings), log=LogSettings.from_args(args, settings),
            memory=MemorySettings.from_args(args, settings), loop=LoopSettings.from_args(args, settings),
            batch=BatchSettings.from_args(args, settings),
            data_files=DataFileSettings.from_args(args, settings),
            schedule=ScheduleSettings.from_args(args, settings), architecture=architecture_from_args(args),
            transformer=core_transformer_config_from_args(args), optimizer=optimizer_config_from_args(args),
            flags=args,
        )

    def with_run_length(self) -> RunConfigs:
        """After the LR schedule's set-up, which turns --train-samples into --train-iters (Megatron's order): the
        run's length from the flags."""
        train_iters = self.flags.train_iters
        return dataclasses.replace(self, loop=dataclasses.replace(self.loop, train_iters=train_iters),
                                   data_files=dataclasses.replace(self.data_files, train_iters=train_iters))
