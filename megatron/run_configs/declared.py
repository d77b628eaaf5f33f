"""Fill a run record from the flags with the defaults the settings declare: one place knows each default.

A record field that shares its name with a declared setting (megatron/settings/) takes the namespace's value, or the
declared default when the namespace lacks it (a namespace from another entry script or an older checkpoint); a field
named like one of the `NOT_FLAGS` values that start-up writes onto ``args`` takes that value or the default listed
there. A record's ``from_args`` passes only its derived fields by hand::

    return fill_from_args(cls, args, load=getattr(args, load_arg, None), qkv_head_dim=...)

Values are normalised by the field's annotation, as the hand-written records did: a ``bool`` field gets ``bool(v)``
(Megatron's store_true flags default to None), and None in a field whose annotation does not allow None takes the
default. Where the declared default is None and the field cannot hold None (``micro_batch_size: int = 1``; a flag
Megatron requires, or a value start-up computes) the record's own default says what an absent value means. A field
without a default in the record is required: a namespace without it raises AttributeError.
tests/test_run_configs_declared.py checks that every record's other defaults are the declared ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from typing import Any, Dict, Optional, TypeVar

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
    """Destination -> default of every declared setting, then of `NOT_FLAGS` (imported on first use: this package
    imports only the standard library when it is loaded)."""
    from megatron.settings import all_settings

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


@functools.cache
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def normalise(hint: Any, value: Any, default: Any) -> Any:
    """A namespace value as a field annotated `hint` holds it (see the module docstring)."""
    if hint is bool:
        return bool(value)
    if value is None and not _allows_none(hint):
        return default
    return value


def record_default(hint: Any, declared: Any, field: dataclasses.Field) -> Any:
    """What an absent value means for a record field: the declared default, unless that is None and the field is
    neither a bool nor able to hold None (then the record's default, if it has one)."""
    if declared is None and hint is not bool and not _allows_none(hint) and field.default is not dataclasses.MISSING:
        return field.default
    return declared


def fill_from_args(cls: type[R], args: Optional[argparse.Namespace], **by_hand: Any) -> R:
    """A `cls` record whose fields in `by_hand` are given and whose others come from `args` (see the module doc).

    Every other field must be named like a declared setting or a `NOT_FLAGS` value (TypeError otherwise: pass it by
    hand)."""
    defaults = declared_defaults()
    hints = _hints(cls)
    values = dict(by_hand)
    for field in dataclasses.fields(cls):
        name = field.name
        if name in by_hand:
            continue
        if name not in defaults:
            raise TypeError(f"{cls.__name__}.{name} is not a declared setting: pass it to fill_from_args by hand")
        default = record_default(hints[name], defaults[name], field)
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        value = getattr(args, name) if required else getattr(args, name, default)
        values[name] = normalise(hints[name], value, default)
    return cls(**values)
