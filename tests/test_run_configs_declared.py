"""The run records (megatron/run_configs/) declare no setting again (issue #36, "one value path per setting"): a
record reads each setting from the `Settings` it holds (megatron/settings/values.py) through a `SettingValue`
attribute, and its dataclass fields are derived values only; a field named like a declared setting must be listed in
`DERIVED` with the reason."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import typing

import pytest

import megatron.run_configs as pkg
from megatron.run_configs.declared import (
    NOT_FLAGS,
    SettingValue,
    declared_defaults,
    from_settings,
    setting_names,
    with_settings,
)
from megatron.settings import all_settings
from megatron.settings.values import Settings

# Record fields named like a setting that hold a value derived from it (record, field): why.
DERIVED = {
    ("CheckpointSettings", "load"): "the folder of the flag named by load_arg (--load, or a task's "
                                    "--pretrained-checkpoint)",
    ("DataFileSettings", "train_iters"): "the run's length once set up (--train-samples becomes --train-iters)",
    ("LoopSettings", "train_iters"): "the run's length once set up (--train-samples becomes --train-iters)",
    ("SavedRunArgs", "tensor_model_parallel_size"): "a saved namespace without it: unknown (None), the files tell",
    ("ThroughputSettings", "seq_length"): "Megatron-DeepSpeed's --actual-seq-length wins over --seq-length",
    ("TokenizerSettings", "make_vocab_size_divisible_by"): "None (a converter's namespace) means no padding (1)",
    ("ConversionOptions", "trust_checkpoint"): "the converter's own --trust-checkpoint (tools/checkpoint/convert.py)",
    ("RunConfigs", "deepspeed"): "the DeepSpeed record, not the --deepspeed switch",
    ("RunConfigs", "optimizer"): "the OptimizerConfig, not the --optimizer name",
}


def _records(include_bundle: bool = False) -> list[type]:
    found: list[type] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name == "bundle" and not include_bundle:
            continue
        module = importlib.import_module(f"megatron.run_configs.{info.name}")
        found += [obj for obj in vars(module).values()
                  if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__]
    return found


RECORDS = _records()
READERS = [cls for cls in RECORDS if setting_names(cls)]


def test_records_found() -> None:
    assert len(RECORDS) >= 16 and all(cls.__dataclass_params__.frozen for cls in RECORDS)
    assert len(READERS) >= 15


def test_no_record_field_is_a_declared_setting() -> None:
    declared = {dest for dest, _default, _spec in all_settings()}
    twice = sorted(f"{cls.__name__}.{field.name}" for cls in _records(include_bundle=True)
                   for field in dataclasses.fields(cls)
                   if field.name in declared and (cls.__name__, field.name) not in DERIVED)
    assert not twice, (f"record fields that declare a setting again: {twice}; read it with `name = SettingValue()`, "
                       "or list it in DERIVED with the reason when the record holds a value derived from it")
    fields = {(cls.__name__, field.name) for cls in _records(include_bundle=True) for field in dataclasses.fields(cls)}
    assert set(DERIVED) <= fields  # no stale entry


def _distinct_namespace() -> argparse.Namespace:
    """Every declared destination set to a value unlike its default (ints, strings, flipped bools)."""
    lists = {dest for dest, _default, spec in all_settings() if spec.parser_kwargs.get("nargs")}
    values = {}
    for i, (name, default) in enumerate(sorted(declared_defaults().items())):
        values[name] = (not default) if isinstance(default, bool) else [f"value-{i}"] if name in lists else (
            f"value-{i}" if isinstance(default, str) else 1000 + i)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("cls", READERS, ids=lambda c: c.__name__)
def test_records_read_the_flags_and_the_declared_default_when_absent(cls: type) -> None:
    full = _distinct_namespace()
    record = cls.from_args(full)
    assert record.settings == Settings.from_args(full)
    for name in setting_names(cls):
        assert getattr(record, name) == vars(cls)[name].normalised(getattr(full, name)), (cls.__name__, name)
    bare = argparse.Namespace(hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=5,
                              data_parallel_size=1, padded_vocab_size=128)
    record = cls.from_args(bare)
    for name in setting_names(cls):
        expected = vars(cls)[name].normalised(getattr(bare, name, declared_defaults()[name]))
        assert getattr(record, name) == expected, (cls.__name__, name)


def test_reading_rules() -> None:
    @dataclasses.dataclass(frozen=True)
    class Record:
        settings: Settings
        model_family: str = NOT_FLAGS["model_family"]
        extra: int = 0

        no_save_optim = SettingValue()  # declared Optional[bool] (Megatron's store_true): bool()
        ckpt_format = SettingValue()  # None where the declared type does not allow None: the declared default
        num_layers = SettingValue(when_none=0)  # declared None: this record's 0
        micro_batch_size = SettingValue()

    record = from_settings(Record, argparse.Namespace(micro_batch_size=3, ckpt_format=None, no_save_optim=None),
                           extra=5)
    assert (record.micro_batch_size, record.no_save_optim, record.ckpt_format, record.model_family,
            record.num_layers, record.extra) == (3, False, "torch", "gpt", 0, 5)
    assert from_settings(Record, argparse.Namespace(num_layers=4), extra=5).num_layers == 4
    changed = with_settings(record, num_layers=7, ckpt_format="torch_dist")
    assert (changed.num_layers, changed.ckpt_format, changed.extra, record.num_layers) == (7, "torch_dist", 5, 0)
    assert setting_names(Record) == ("no_save_optim", "ckpt_format", "num_layers", "micro_batch_size")
    assert typing.get_type_hints(Record)["extra"] is int

    @dataclasses.dataclass(frozen=True)
    class Other:
        settings: Settings
        extra: int = 0

    with pytest.raises(TypeError, match="Other.extra is a derived value"):
        from_settings(Other, argparse.Namespace())
    with pytest.raises((TypeError, RuntimeError)) as info:
        type("Bad", (), {"not_a_setting": SettingValue()})
    assert "Bad.not_a_setting names no declared setting" in str(info.value) + str(info.value.__cause__)
