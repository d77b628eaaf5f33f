"""How a run record gets its values: it reads the settings, and holds only what is derived from them.

A run record (megatron/run_configs/) holds the run's `Settings` (megatron/settings/values.py: the settings groups
instantiated from the flags) and reads a setting through a `SettingValue` attribute named like it, so that the name,
type and default are declared once, in the group; its dataclass fields are derived values only (the folder the flag
named by ``load_arg`` gives, the padded vocabulary, the run's length after set-up, ...). A derived field named like
one of the `NOT_FLAGS` values that start-up writes onto ``args`` takes that value, or the default listed there; a
record's ``from_args`` passes its other derived fields by hand::

    return from_settings(cls, args, settings, load=getattr(args, load_arg, None), qkv_head_dim=...)

A value is normalised by the setting's declared annotation, as the hand-written records did: a ``bool`` (or
Optional[bool]) setting reads ``bool(v)`` (Megatron's store_true flags default to None), and None where the
annotation does not allow None reads the declared default; ``SettingValue(when_none=1)`` says what None means for a
record where the declared default is None (``micro_batch_size``: 1 in the memory estimate).
tests/test_run_configs_declared.py checks that no record field is named like a setting unless it is listed there
as a derived value with the reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from typing import Any, Dict, Optional, TypeVar

from megatron.settings import all_settings
from megatron.settings.values import Settings, declared_hint, group_of

R = TypeVar("R")

# Values start-up writes onto ``args`` that no flag declares (who writes them): their value when absent.
NOT_FLAGS: Dict[str, Any] = {
    "model_family": "gpt",  # the entry script (pretrain_bert.py: "bert", ...)
    "rank": 0,  # initialize.py
    "world_size": 1,  # initialize.py
    "data_parallel_size": None,  # validate_args
    "virtual_pipeline_model_parallel_size": None,  # validate_args, from --num-layers-per-virtual-pipeline-stage
    "padded_vocab_size": None,  # the tokenizer
    "true_vocab_size": None,  # checkpoint conversion (tools/checkpoint/convert.py)
}


@functools.cache
def declared_defaults() -> Dict[str, Any]:
    """Destination -> default of every declared setting, then of `NOT_FLAGS`."""
    defaults: Dict[str, Any] = {}
    for dest, default, _spec in all_settings():
        defaults.setdefault(dest, default)
    for name, default in NOT_FLAGS.items():
        defaults.setdefault(name, default)
    return defaults


def flag_value(args: Optional[argparse.Namespace], name: str) -> Any:
    """``args.name``, or the declared default when `args` lacks it (for a record's derived fields)."""
    return getattr(args, name, declared_defaults()[name])


def _allows_none(hint: Any) -> bool:
    return hint is Any or (typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint))


def _is_bool(hint: Any) -> bool:
    if typing.get_origin(hint) is typing.Union:
        return [a for a in typing.get_args(hint) if a is not type(None)] == [bool]
    return hint is bool


class SettingValue:
    """A record attribute that reads the setting it is named after from the record's ``settings`` (see the module
    docstring); `when_none`: what None means for this record (None: None)."""

    def __init__(self, when_none: Any = None) -> None:
        self.when_none = when_none
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if name not in group_of():
            raise TypeError(f"{owner.__name__}.{name} names no declared setting: make it a derived field")
        self.name = name

    def __get__(self, record: Any, owner: Optional[type] = None) -> Any:
        if record is None:
            return self
        return self.normalised(record.settings.value(self.name))

    def normalised(self, value: Any) -> Any:
        """`value` of the setting as this record reads it."""
        hint = declared_hint(self.name)
        if _is_bool(hint):
            return bool(value)
        if value is None and not _allows_none(hint):
            return declared_defaults()[self.name]
        return self.when_none if value is None else value


def with_settings(record: R, **values: Any) -> R:
    """A copy of `record` whose settings in `values` are changed (`dataclasses.replace` for what it reads)."""
    return dataclasses.replace(record, settings=record.settings.with_values(**values))


def setting_names(cls: type) -> tuple[str, ...]:
    """The settings record class `cls` reads (its `SettingValue` attributes), in declaration order."""
    return tuple(name for klass in reversed(cls.__mro__) for name, attr in vars(klass).items()
                 if isinstance(attr, SettingValue))


@functools.cache
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def normalise(hint: Any, value: Any, default: Any) -> Any:
    """A namespace value as a derived field annotated `hint` holds it: bool(v) for a bool, the default for None
    where the annotation does not allow None."""
    if hint is bool:
        return bool(value)
    if value is None and not _allows_none(hint):
        return default
    return value


def record_default(hint: Any, listed: Any, field: dataclasses.Field) -> Any:
    """What an absent `NOT_FLAGS` value means for a derived field: the listed default, unless that is None and the
    field is neither a bool nor able to hold None (then the record's default, if it has one)."""
    if listed is None and hint is not bool and not _allows_none(hint) and field.default is not dataclasses.MISSING:
        return field.default
    return listed


def from_settings(cls: type[R], args: Optional[argparse.Namespace], settings: Optional[Settings] = None,
                  **by_hand: Any) -> R:
    """A `cls` record holding `settings` (default: `Settings.from_args(args)`), the derived fields in `by_hand`, and
    its other derived fields, each named like a `NOT_FLAGS` value, from `args` (TypeError for any other name)."""
    hints = _hints(cls)
    values = dict(by_hand, settings=settings if settings is not None else Settings.from_args(args))
    for field in dataclasses.fields(cls):
        name = field.name
        if name in values:
            continue
        if name not in NOT_FLAGS:
            raise TypeError(f"{cls.__name__}.{name} is a derived value that start-up does not write onto args: "
                            "pass it to from_settings by hand")
        default = record_default(hints[name], NOT_FLAGS[name], field)
        values[name] = normalise(hints[name], getattr(args, name, default), default)
    return cls(**values)
