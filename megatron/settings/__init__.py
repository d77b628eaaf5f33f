"""Every core setting, declared once: the settings groups in ``--help`` order and the tables derived from them.

Each group is a dataclass of `setting(...)` fields (megatron/settings/declare.py says what a declaration holds).
`add_core_groups` / `add_last_groups` build the parser from them; `config_fields` is `config_flags.CONFIG_FIELDS`,
`architecture_fields` is `checkpoint.args.ARCHITECTURE_FIELDS` (in the record's declared order, which fixes the
checkpoint's bytes), and `runtime_settings` / `same_result_variants` / `refused` / `family_only` are the tables in
`megatron.settings.flag_registry`; `kept_fields` is the converter's architecture (`interchange._KEPT_FIELDS`),
`config_flag` / `flag_spelling` the option strings tools print, `optimizer_fields` the `OptimizerConfig`'s. The
groups entry scripts add themselves (`ENTRY_GROUPS`) are declared here too. `Settings` (values.py) holds every group's
values for one run. To add a flag: one `setting(...)` line in the group it belongs to.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, Iterator, List, Tuple

from megatron.settings.checkpointing import CheckpointingSettings
from megatron.settings.data import DataSettings
from megatron.settings.declare import ConfigField, Getter, Spec, add_group, flags_of, from_args, settings_of
from megatron.settings.deepspeed import DeepSpeedSettings
from megatron.settings.generation import RandomWeightsSettings, TextGenerationServerSettings, TextGenerationSettings
from megatron.settings.logs import InferenceSettings, LoggingSettings
from megatron.settings.model import NetworkSizeSettings
from megatron.settings.moe import MoESettings
from megatron.settings.optimizer import LearningRateSettings, RegularizationSettings
from megatron.settings.parallel import DistributedSettings, MixedPrecisionSettings
from megatron.settings.tasks import EvalHarnessSettings, TasksSettings
from megatron.settings.training import InitializationSettings, TrainingSettings, ValidationSettings
from megatron.settings.values import Settings

__all__ = ["CORE_GROUPS", "ENTRY_GROUPS", "LAST_GROUPS", "ConfigField", "EvalHarnessSettings", "RandomWeightsSettings",
           "TasksSettings",
           "TextGenerationServerSettings", "TextGenerationSettings", "add_core_groups", "add_group", "add_last_groups",
           "all_settings", "flags_of",
           "architecture_fields", "config_fields", "config_flag", "flag_spelling", "kept_fields", "optimizer_fields", "Settings", "family_only", "filled_if_unset", "flag_hints", "from_args",
           "refused", "restore_rules", "runtime_settings", "same_result_variants"]

# Megatron's groups, in its parser's order (the entry script's own groups follow, then LAST_GROUPS).
CORE_GROUPS: Tuple[type, ...] = (
    NetworkSizeSettings, RegularizationSettings, TrainingSettings, InitializationSettings, LearningRateSettings,
    CheckpointingSettings, MixedPrecisionSettings, DistributedSettings, ValidationSettings, DataSettings,
    LoggingSettings, InferenceSettings, MoESettings,
)
# Added last, leaving out the flags a provider already added (deepspeed.add_config_arguments).
LAST_GROUPS: Tuple[type, ...] = (DeepSpeedSettings,)
# The groups entry scripts add themselves (their extra_args_provider calls add_group): tasks/main.py,
# tasks/eval_harness/evaluate.py, tools/generate_samples_gpt.py, tools/run_text_generation_server.py.
ENTRY_GROUPS: Tuple[type, ...] = (TasksSettings, EvalHarnessSettings, TextGenerationSettings,
                                  TextGenerationServerSettings, RandomWeightsSettings)


def add_core_groups(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for group in CORE_GROUPS:
        parser = add_group(parser, group)
    return parser


def add_last_groups(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for group in LAST_GROUPS:
        parser = add_group(parser, group, skip_existing=True)
    return parser


def all_settings() -> Iterator[Tuple[str, Any, Spec]]:
    """(destination, default, spec) of every declared setting: the core ones in parser order, then the entry scripts'."""
    for group in CORE_GROUPS + LAST_GROUPS + ENTRY_GROUPS:
        yield from settings_of(group)


_SPECS: Dict[str, Spec] = {dest: spec for dest, _default, spec in all_settings()}


def _copy(dest: str) -> Getter:
    return lambda args: getattr(args, dest)


def config_fields() -> Dict[str, Tuple[Tuple[str, ...], Getter]]:
    """TransformerConfig field -> (the destinations it is computed from, how): `config_flags.CONFIG_FIELDS`."""
    sources: Dict[str, List[str]] = {}
    getters: Dict[str, Getter] = {}
    for dest, _default, spec in all_settings():
        for field in spec.config:
            name = field.name or dest
            if name in getters:
                raise ValueError(f"config field {name!r} is declared by two settings")
            getters[name] = field.compute or _copy(dest)
            sources.setdefault(name, []).insert(0, dest)
        for name in spec.feeds:
            sources.setdefault(name, []).append(dest)
    missing = set(sources) - set(getters)
    if missing:
        raise ValueError(f"settings feed config fields no setting declares: {sorted(missing)}")
    return {name: (tuple(sources[name]), getter) for name, getter in getters.items()}


def _config_items() -> Iterator[Tuple[str, ConfigField]]:
    for dest, _default, spec in all_settings():
        for field in spec.config:
            yield field.name or dest, field


def _placed(position: Callable[[ConfigField], Any], what: str) -> Tuple[str, ...]:
    """The config fields with a position (`position(field)` not None), in position order (0, 1, ... once each)."""
    placed = sorted((position(field), name) for name, field in _config_items() if position(field) is not None)
    positions = [pos for pos, _ in placed]
    if positions != list(range(len(placed))):
        raise ValueError(f"{what} positions must be 0..{len(placed) - 1} once each: {positions}")
    return tuple(name for _, name in placed)


def architecture_fields() -> Tuple[str, ...]:
    """The config fields in the checkpoint's ``architecture`` record, in their declared order (0, 1, ...)."""
    return _placed(lambda field: field.arch, "architecture record")


def kept_fields() -> Tuple[str, ...]:
    """The config fields a converted model keeps (tools/checkpoint/convert.py's architecture), in declared order."""
    return _placed(lambda field: field.kept, "converted architecture")


def flag_spelling(dest: str) -> str:
    """The option string tools print for setting `dest`: its first one, or the one its config field's mismatch hint
    names (--norm-epsilon for --layernorm-epsilon)."""
    spec = _SPECS[dest]
    hints = [field.hint for field in spec.config if field.hint in spec.flags]
    return hints[0] if hints else spec.flags[0]


def config_flag(name: str) -> str:
    """The option string of the setting that declares config field `name` (`flag_spelling` of its destination)."""
    return flag_spelling(next(dest for dest, _default, spec in all_settings()
                              for field in spec.config if (field.name or dest) == name))


def optimizer_fields() -> Tuple[str, ...]:
    """The settings that are `OptimizerConfig` fields (`setting(..., optimizer_config=True)`), in declaration order."""
    return tuple(dest for dest, _default, spec in all_settings() if spec.optimizer_config)


def flag_hints() -> Dict[str, str]:
    """Architecture field -> what to pass for it, where that is not simply --field-name."""
    return {name: field.hint for name, field in _config_items() if field.hint is not None}


def restore_rules() -> Dict[str, List[Tuple[str, Callable[[Any], Any]]]]:
    """Field -> [(destination, its value for a saved field value)] for --use-checkpoint-args, where not the field."""
    return {name: list(field.restore) for name, field in _config_items() if field.restore is not None}


def filled_if_unset() -> Tuple[str, ...]:
    """Destinations --use-checkpoint-args restores only when the flag is left at its default."""
    return tuple(dest for dest, _default, spec in all_settings() if spec.restore_if_unset)


def runtime_settings() -> Dict[str, str]:
    """Destination -> the file that reads it."""
    return {dest: spec.read_by for dest, _default, spec in all_settings() if spec.read_by is not None}


def same_result_variants() -> Dict[str, str]:
    """Destination -> why any value gives the same numbers here."""
    return {dest: spec.variant for dest, _default, spec in all_settings() if spec.variant is not None}


def refused() -> Dict[str, Tuple[Any, str]]:
    """Destination -> (default, why another value is refused)."""
    return {dest: (default, spec.refused) for dest, default, spec in all_settings() if spec.refused is not None}


def family_only() -> Dict[str, Tuple[Tuple[str, ...], Any]]:
    """Destination -> (the model families that read it, default)."""
    return {dest: (spec.families, default) for dest, default, spec in all_settings() if spec.families}
