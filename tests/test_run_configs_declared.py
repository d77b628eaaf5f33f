"""The run records (megatron/run_configs/) take their plain fields from the settings'
declarations (megatron/run_configs/declared.py): a field named like a setting has the declared default and carries
the flag's value, so a record's defaults cannot drift from the flags' (issue #23: each setting declared once)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import typing

import pytest

import megatron.run_configs as pkg
from megatron.run_configs.declared import NOT_FLAGS, declared_defaults, fill_from_args, normalise, record_default
from megatron.settings import all_settings

# Record fields named like a setting whose default deliberately differs from the flag's (record, field): why.
DIFFERENT_ON_PURPOSE = {
    ("SavedRunArgs", "tensor_model_parallel_size"): "a saved namespace without it: unknown, the files tell",
}


def _records() -> list[type]:
    found: list[type] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name == "bundle":  # RunConfigs holds the records (tests/test_run_configs_built_once.py)
            continue
        module = importlib.import_module(f"megatron.run_configs.{info.name}")
        found += [obj for obj in vars(module).values()
                  if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__]
    return found


RECORDS = _records()


def _has_default(field: dataclasses.Field) -> bool:
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def test_records_found() -> None:
    assert len(RECORDS) >= 13 and all(cls.__dataclass_params__.frozen for cls in RECORDS)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_record_defaults_are_the_declared_ones(cls: type) -> None:
    defaults = declared_defaults()
    hints = typing.get_type_hints(cls)
    drift = {}
    for field in dataclasses.fields(cls):
        if field.name in defaults and _has_default(field) and (cls.__name__, field.name) not in DIFFERENT_ON_PURPOSE:
            absent = record_default(hints[field.name], defaults[field.name], field)
            declared = normalise(hints[field.name], absent, absent)
            if field.default != declared:
                drift[field.name] = (field.default, declared)
    assert not drift, (f"{cls.__name__} field defaults differ from the declared ones (record, declared): {drift}; "
                       "give the field the declared default or no default, or pass it by hand in from_args and list "
                       "it in DIFFERENT_ON_PURPOSE with the reason")


def _distinct_namespace() -> argparse.Namespace:
    """Every declared destination set to a value unlike its default (ints, strings, flipped bools)."""
    lists = {dest for dest, _default, spec in all_settings() if spec.parser_kwargs.get("nargs")}
    values = {}
    for i, (name, default) in enumerate(sorted(declared_defaults().items())):
        values[name] = (not default) if isinstance(default, bool) else [f"value-{i}"] if name in lists else (
            f"value-{i}" if isinstance(default, str) else 1000 + i)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_record_fields_carry_the_flags_and_default_when_absent(cls: type) -> None:
    hints = typing.get_type_hints(cls)
    defaults = declared_defaults()
    named = [f for f in dataclasses.fields(cls) if f.name in defaults]
    assert named, cls
    full = _distinct_namespace()
    record = cls.from_args(full)
    for field in named:
        assert getattr(record, field.name) == normalise(hints[field.name], getattr(full, field.name), None), \
            (cls.__name__, field.name)
    # A namespace holding only what the record requires: every other setting-named field takes its default.
    required = {f.name: getattr(full, f.name) for f in dataclasses.fields(cls) if not _has_default(f)}
    bare = argparse.Namespace(**{"hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, **required})
    record = cls.from_args(bare)
    for field in named:
        if _has_default(field) and field.name not in vars(bare):
            assert getattr(record, field.name) == field.default, (cls.__name__, field.name)


def test_fill_from_args_rules() -> None:
    @dataclasses.dataclass(frozen=True)
    class Record:
        micro_batch_size: typing.Optional[int]  # required: a namespace without it is an error
        no_save_optim: bool = False  # declared default None (Megatron's store_true): bool()
        ckpt_format: str = "torch"  # None where None is not allowed: the default
        model_family: str = NOT_FLAGS["model_family"]
        num_layers: int = 0  # declared None, which an int cannot hold: absent or None means the record's 0
        extra: int = 0

    record = fill_from_args(Record, argparse.Namespace(micro_batch_size=3, ckpt_format=None), extra=5)
    assert record == Record(3, False, "torch", "gpt", 0, 5)
    assert fill_from_args(Record, argparse.Namespace(micro_batch_size=3, num_layers=None), extra=5).num_layers == 0
    assert fill_from_args(Record, argparse.Namespace(micro_batch_size=3, num_layers=4), extra=5).num_layers == 4
    with pytest.raises(AttributeError):
        fill_from_args(Record, argparse.Namespace(), extra=1)
    with pytest.raises(TypeError, match="Record.extra is not a declared setting"):
        fill_from_args(Record, argparse.Namespace(micro_batch_size=1))
