"""`Settings`: the settings groups instantiated once from the parsed flags, one attribute per group.

The groups (megatron/settings/*.py) declare each setting once; `Settings.from_args(args)` holds their values for one
run (a namespace from another entry script or an older checkpoint may lack some destinations: those take the declared
default). `RunConfigs` (megatron/run_configs/bundle.py) holds it, and the run records read a setting's value from it
(`Settings.value`) rather than declaring the field again.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from typing import Any, Dict, Optional

from megatron.settings.checkpointing import CheckpointingSettings
from megatron.settings.data import DataSettings
from megatron.settings.declare import from_args
from megatron.settings.deepspeed import DeepSpeedSettings
from megatron.settings.generation import RandomWeightsSettings, TextGenerationServerSettings, TextGenerationSettings
from megatron.settings.logs import InferenceSettings, LoggingSettings
from megatron.settings.model import NetworkSizeSettings
from megatron.settings.moe import MoESettings
from megatron.settings.optimizer import LearningRateSettings, RegularizationSettings
from megatron.settings.parallel import DistributedSettings, MixedPrecisionSettings
from megatron.settings.tasks import EvalHarnessSettings, TasksSettings
from megatron.settings.training import InitializationSettings, TrainingSettings, ValidationSettings


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every settings group's values for one run (the core groups in --help order, DeepSpeed's, the entry scripts')."""

    network_size: NetworkSizeSettings
    regularization: RegularizationSettings
    training: TrainingSettings
    initialization: InitializationSettings
    learning_rate: LearningRateSettings
    checkpointing: CheckpointingSettings
    mixed_precision: MixedPrecisionSettings
    distributed: DistributedSettings
    validation: ValidationSettings
    data: DataSettings
    logging: LoggingSettings
    inference: InferenceSettings
    moe: MoESettings
    deepspeed: DeepSpeedSettings
    tasks: TasksSettings
    eval_harness: EvalHarnessSettings
    text_generation: TextGenerationSettings
    text_generation_server: TextGenerationServerSettings
    random_weights: RandomWeightsSettings

    @classmethod
    def from_args(cls, args: Optional[argparse.Namespace]) -> Settings:
        """Each group from `args` (None, or destinations it lacks: the declared defaults)."""
        ns = args if args is not None else argparse.Namespace()
        return cls(**{name: from_args(group, ns) for name, group in group_types().items()})

    def value(self, dest: str) -> Any:
        """The value of setting `dest` (KeyError: no group declares it)."""
        return getattr(getattr(self, group_of()[dest]), dest)

    def with_values(self, **values: Any) -> Settings:
        """A copy with the settings in `values` changed (KeyError: no group declares one)."""
        groups: Dict[str, Dict[str, Any]] = {}
        for dest, value in values.items():
            groups.setdefault(group_of()[dest], {})[dest] = value
        return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **changed)
                                            for name, changed in groups.items()})


@functools.cache
def group_types() -> Dict[str, type]:
    """Settings attribute -> its group's dataclass."""
    return dict(typing.get_type_hints(Settings))


@functools.cache
def group_of() -> Dict[str, str]:
    """Destination -> the Settings attribute of the group that declares it."""
    out: Dict[str, str] = {}
    for name, group in group_types().items():
        for field in dataclasses.fields(group):
            out.setdefault(field.name, name)
    return out


@functools.cache
def declared_hint(dest: str) -> Any:
    """The annotation setting `dest` is declared with."""
    return typing.get_type_hints(group_types()[group_of()[dest]])[dest]
