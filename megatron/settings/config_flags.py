"""Which command-line flag becomes which `TransformerConfig` field: the one explicit bridge from flags to config.

`CONFIG_FIELDS` (field -> (the parser destinations it is computed from, how)) is derived from the settings'
declarations (megatron/settings/: `setting(..., config=...)`); nothing is copied "because the name happens to
match". `megatron.settings.flag_registry` lists the other destinations (run-time settings read by training, data,
checkpointing, ...) and the flags that are refused; tests/test_every_flag.py checks that every destination of every
entry script is in one of the two places.

To add an architecture flag: add the field to `TransformerConfig` (megatron/core/transformer_config.py) and one
`setting(...)` line to its group in megatron/settings/ with ``config=True`` (or a `ConfigField` naming the field,
how it is computed when it is not a plain copy, and its position in the checkpoint's architecture record).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Dict, Tuple

from megatron.settings import config_fields

Getter = Callable[[argparse.Namespace], Any]

# field -> (parser destinations it is computed from, how). Derived values (params_dtype, position_embedding_type,
# ffn_hidden_size, kv_channels, ...) are those validate_args has filled in.
CONFIG_FIELDS: Dict[str, Tuple[Tuple[str, ...], Getter]] = config_fields()


def config_mapped_dests() -> Dict[str, str]:
    """Parser destination -> the config field(s) it feeds (for the every-flag test and error messages)."""
    out: Dict[str, str] = {}
    for name, (dests, _) in CONFIG_FIELDS.items():
        for dest in dests:
            out[dest] = f"{out[dest]}, {name}" if dest in out else name
    return out


def dests_without_config_field(config_cls: type) -> Tuple[str, ...]:
    """Destinations that feed only fields `config_cls` does not declare (set to a non-default value: refused)."""
    declared = {f.name for f in dataclasses.fields(config_cls)}
    feeding: Dict[str, bool] = {}
    for name, (dests, _) in CONFIG_FIELDS.items():
        for dest in dests:
            feeding[dest] = feeding.get(dest, False) or name in declared
    return tuple(dest for dest, used in feeding.items() if not used)


def config_kwargs_from_args(config_cls: type, args: argparse.Namespace) -> Dict[str, Any]:
    """The keyword arguments of `config_cls` computed from validated `args` through `CONFIG_FIELDS`.

    Only fields `config_cls` declares are passed (so the table may name fields of a newer config); a getter that
    yields None, or reads a flag an older namespace (a checkpoint's saved args) does not have, leaves the field at
    its default.
    """
    declared = {f.name for f in dataclasses.fields(config_cls)}
    kwargs: Dict[str, Any] = {}
    for name, (_dests, getter) in CONFIG_FIELDS.items():
        if name not in declared:
            continue
        try:
            value = getter(args)
        except AttributeError:
            continue
        if value is not None:
            kwargs[name] = value
    return kwargs
