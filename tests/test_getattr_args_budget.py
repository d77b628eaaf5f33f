"""`getattr(args` stays in the settings adapter: library modules take typed configs (issue #23).

The adapter is megatron/run_configs/run_settings.py and megatron/run_configs/ (typed records built once from the flags, the one
place that reads optional flags with their defaults). The flag layer (the parser, the flag declarations and the
start-up validation, which read and write the namespace itself) and megatron/global_vars.py are the namespace's own
side. Every other file under megatron/ has a ceiling below (the occurrences measured when the typed configs landed):
a file may go down, never up, and a new file starts at 0.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDLE = "getattr(args"
ADAPTER = ("megatron/run_configs/run_settings.py", "megatron/run_configs/")

# The flag layer, not capped here: declaring, parsing, validating and recording flags is its job (arguments.py,
# config_flags.py, checkpoint/args.py, flag_registry.py, moe_checks.py, cli_parser.py hold the settings'
# declarations; required_flags.py refuses missing flags at start-up; ds/config.py reconciles the DeepSpeed JSON with
# the flags inside validate_args and writes the result onto args); global_vars.py holds args.
FLAG_LAYER = ("megatron/settings/", "megatron/arguments.py", "megatron/settings/config_flags.py", "megatron/checkpoint/args.py",
              "megatron/settings/flag_registry.py", "megatron/settings/moe_checks.py", "megatron/settings/cli_parser.py",
              "megatron/settings/required_flags.py", "megatron/ds/config.py", "megatron/global_vars.py")
# megatron/settings/ is the settings' one declaration (groups of flags; their from_args reads the namespace).
# Library modules: the occurrences left when the typed configs landed (a file may go down, never up; others: 0).
LIBRARY = {
    "megatron/training.py": 1,  # pretrain()'s entry side: padded_vocab_size (the run records: RunConfigs)
    "megatron/data/preprocessing.py": 3,  # tools/preprocess_data.py's own namespace
    "megatron/optimizer/optimizer_config.py": 2,  # optimizer_config_from_args: the optimizer's typed config builder
    "megatron/checkpoint/conversion/driver.py": 2,  # tools/checkpoint/convert.py's namespace
    "megatron/training_state.py": 1,  # TrainingState.from_args: Megatron's names on args -> the run state
    "megatron/checkpoint/conversion/megatron_format.py": 1,  # the saver's namespace for the written checkpoint
}
LIBRARY_TOTAL = sum(LIBRARY.values())


def counts() -> dict[str, int]:
    out = {}
    for path in sorted((ROOT / "megatron").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        n = path.read_text(encoding="utf-8").count(NEEDLE)
        if n and not rel.startswith(ADAPTER):
            out[rel] = n
    return out


def test_getattr_args_only_goes_down() -> None:
    found = counts()
    over = {f: (n, LIBRARY.get(f, 0)) for f, n in found.items()
            if not f.startswith(FLAG_LAYER) and n > LIBRARY.get(f, 0)}
    assert not over, (f"{NEEDLE} above its ceiling (file: (now, ceiling)): {over}; take a typed config from "
                      "megatron/run_configs/ (or add a field there) instead of reading args")
    library = sum(n for f, n in found.items() if not f.startswith(FLAG_LAYER))
    assert library <= LIBRARY_TOTAL, f"{library} {NEEDLE} in library modules (ceiling {LIBRARY_TOTAL})"


def test_adapter_records_are_frozen_and_build_from_a_bare_namespace() -> None:
    """Every record in megatron/run_configs/ is a frozen dataclass whose from_args accepts a namespace lacking the
    optional flags (an older checkpoint's or another entry script's)."""
    import argparse
    import dataclasses
    import importlib
    import pkgutil

    import megatron.run_configs as pkg

    bare = argparse.Namespace(
        pipeline_model_parallel_size=1, micro_batch_size=2, data_parallel_size=1, seq_length=16, hidden_size=32,
        num_layers=2, padded_vocab_size=128, fp16=False, bf16=False, DDP_impl="local",
        accumulate_allreduce_grads_in_fp32=False, num_attention_heads=4)
    records = []
    for info in pkgutil.iter_modules(pkg.__path__):
        # bundle: RunConfigs holds the records (tests/test_run_configs_built_once.py); run_settings: the loop's
        # settings, built from a training run's full namespace
        if info.name in ("bundle", "run_settings"):
            continue
        module = importlib.import_module(f"megatron.run_configs.{info.name}")
        records += [obj for obj in vars(module).values()
                    if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__]
    assert len(records) >= 8
    for cls in records:
        record = cls.from_args(bare)
        assert cls.__dataclass_params__.frozen, cls
        field = dataclasses.fields(record)[0].name
        try:
            setattr(record, field, None)
        except dataclasses.FrozenInstanceError:
            pass
        else:
            raise AssertionError(f"{cls.__name__} is not read-only")
