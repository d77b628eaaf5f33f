"""The run's typed records are built once, in pretrain() (its body `_pretrain_attempt`), and passed down (issue #23, "Settings and state").

An AST scan of the training loop, the backends, the model set-up and the checkpoint code: no library function there
builds a record from the flags (``X.from_args(args)``) except Megatron's public wrappers that take no records
(`WRAPPERS`); no function takes a parameter named ``args`` except those wrappers and the flag-layer functions that
read or write the namespace by design (`FLAG_SIDE`); pretrain() builds `RunConfigs` exactly once; the reads of the
transitional ``configs.flags`` stay under their ceiling (a file may go down, never up). No processes.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AREA = ("megatron/training.py", "megatron/model_setup.py", "megatron/backend/__init__.py", "megatron/backend/base.py",
        "megatron/backend/megatron.py", "megatron/backend/deepspeed.py", "megatron/checkpoint/paths.py",
        "megatron/checkpoint/rng.py", "megatron/checkpoint/saving.py", "megatron/checkpoint/selection.py",
        "megatron/checkpoint/loading.py", "megatron/checkpoint/args.py", "megatron/checkpoint/formats.py",
        "megatron/initialize.py", "megatron/compat.py")
# Megatron's public signatures users call with the flags (or none: the global flags); each builds the record it
# needs and calls the typed core (write_checkpoint, read_checkpoint, check_checkpoint_layout, build_model).
WRAPPERS = {("megatron/compat.py", "save_checkpoint"),
            ("megatron/compat.py", "load_checkpoint"),
            ("megatron/compat.py", "check_checkpoint_args"),
            ("megatron/compat.py", "check_architecture"),
            ("megatron/model_setup.py", "get_model")}
# The namespace's own side: pretrain() parses the flags and builds the records; start-up records the process's
# rank, world size and backend on them (finish_mpu_init, Megatron's name, over typed _start_process_group and
# _initialize_model_parallel); --use-checkpoint-args writes the checkpoint's architecture
# onto them before validation; the LR schedule's builder turns --train-samples into --train-iters on them (as
# Megatron's does; also used by megatron/ds/engine.py); args_to_save copies them for a checkpoint.
FLAG_SIDE = {("megatron/training.py", "_pretrain_attempt"),  # pretrain()'s body (in-process restarts rerun it)
             ("megatron/initialize.py", "initialize_megatron"),  # its args: Megatron's argv list
             ("megatron/initialize.py", "finish_mpu_init"),
             ("megatron/compat.py", "load_args_from_checkpoint"),
             ("megatron/compat.py", "restore_architecture"),
             ("megatron/compat.py", "use_checkpoint_args"),
             ("megatron/compat.py", "args_to_save"),
             ("megatron/compat.py", "_set_flags"),
             ("megatron/model_setup.py", "record_run_length"),
             ("megatron/model_setup.py", "get_optimizer_param_scheduler"),
             ("megatron/model_setup.py", "update_train_iters")}
# ``configs.flags`` reads left per file (record_run_length writing the run's length; Megatron's ``args`` record in
# checkpoints and what Megatron records on it).
FLAGS_CEILING = {"megatron/training.py": 2, "megatron/backend/megatron.py": 1, "megatron/backend/deepspeed.py": 2,
                 "megatron/checkpoint/saving.py": 1}


def _functions(rel: str) -> list[ast.FunctionDef]:
    tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _builds_from_args(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "from_args"
               and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "args" for n in ast.walk(fn))


def test_library_functions_take_records_not_args() -> None:
    builds, takes = [], []
    for rel in AREA:
        for fn in _functions(rel):
            if (rel, fn.name) in WRAPPERS or (rel, fn.name) in FLAG_SIDE:
                continue
            if _builds_from_args(fn):
                builds.append(f"{rel}:{fn.name}")
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
            if "args" in params:
                takes.append(f"{rel}:{fn.name}")
    assert not builds, f"build a record from args (take it from RunConfigs instead): {builds}"
    assert not takes, f"take args (take RunConfigs or one record instead): {takes}"


def test_pretrain_builds_the_records_once() -> None:
    (pretrain,) = [fn for fn in _functions("megatron/training.py") if fn.name == "_pretrain_attempt"]
    builds = [n for n in ast.walk(pretrain) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr == "from_args"]
    assert [(b.func.value.id, b.args[0].id) for b in builds] == [("RunConfigs", "args")]
    for fn in _functions("megatron/training.py"):
        if fn.name != "_pretrain_attempt":
            assert not [n for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr == "from_args"], fn.name


def test_flags_reads_only_go_down() -> None:
    found = {rel: (ROOT / rel).read_text(encoding="utf-8").count(".flags") for rel in AREA}
    over = {rel: (n, FLAGS_CEILING.get(rel, 0)) for rel, n in found.items() if n > FLAGS_CEILING.get(rel, 0)}
    assert not over, f"configs.flags reads above the ceiling (file: (now, ceiling)): {over}; read a record"


def _flags(*extra: str):
    from megatron.arguments import parse_args, validate_args

    args = validate_args(parse_args(None, False, [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", *extra]), {})
    args.padded_vocab_size = 128
    return args


def test_the_bundle_holds_the_records_the_flags_give() -> None:
    from megatron.run_configs.bundle import RunConfigs
    from megatron.run_configs.checkpoint import CheckpointSettings
    from megatron.run_configs.step import StepSettings

    args = _flags("--train-samples", "64", "--save", "/tmp/x", "--eval-iters", "3")
    configs = RunConfigs.from_args(args)
    assert configs.checkpoint == CheckpointSettings.from_args(args)
    assert configs.step == StepSettings.from_args(args)
    assert (configs.batch.global_batch_size, configs.batch.eval_iters, configs.loop.save) == (4, 3, "/tmp/x")
    assert configs.architecture["hidden_size"] == 32 and configs.transformer.hidden_size == 32
    assert configs.flags is args
    args.train_iters = 16  # what the LR schedule's set-up does with --train-samples 64 / --global-batch-size 4
    resolved = configs.with_run_length()
    assert (resolved.loop.train_iters, resolved.data_files.train_iters, configs.loop.train_iters) == (16, 16, None)


def test_megatron_signatures_read_the_global_flags(tmp_path) -> None:
    """save_checkpoint(iteration, model, optimizer, opt_param_scheduler) and load_checkpoint(model, optimizer,
    opt_param_scheduler) without records: the wrappers take the global flags (and keep the counters on them)."""
    import torch

    from megatron import global_vars
    from megatron.checkpointing import load_checkpoint, save_checkpoint  # as Megatron users' scripts import them

    args = _flags("--train-iters", "8", "--save", str(tmp_path), "--load", str(tmp_path))
    args.consumed_train_samples = 12
    global_vars.set_args(args)
    try:
        model = torch.nn.Linear(2, 2)
        save_checkpoint(3, [model], None, None)
        args.consumed_train_samples = 0
        other = torch.nn.Linear(2, 2)
        assert load_checkpoint([other], None, None) == 3
    finally:
        global_vars.set_args(None)
    assert torch.equal(other.weight, model.weight) and args.consumed_train_samples == 12


def test_the_schedule_record_builds_megatrons_scheduler() -> None:
    """The bundle's ScheduleSettings (the flags as parsed) give the scheduler get_optimizer_param_scheduler(args) gives
    (decay/warm-up/wd-increment lengths in samples), and the flag-layer step writes the run's length onto args."""
    import argparse

    import torch

    from megatron.model_setup import build_param_scheduler, get_optimizer_param_scheduler, record_run_length
    from megatron.run_configs.bundle import RunConfigs

    def sched(optimizer_args: argparse.Namespace, build) -> dict:
        return build(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0), optimizer_args).state_dict()

    for extra, steps, written in (
            (("--train-samples", "64", "--lr-warmup-fraction", "0.25"), (16, 64, 64), {"train_iters": 16,
                                                                                       "lr_decay_samples": 64}),
            (("--train-iters", "8", "--lr-warmup-iters", "2", "--lr-decay-iters", "6"), (8, 24, 32),
             {"train_iters": 8, "lr_decay_iters": 6}),
            (("--train-iters", "8", "--lr-decay-style", "cosine"), (0, 32, 32), {"lr_decay_iters": 8})):
        args = _flags(*extra, "--min-lr", "1e-4", "--weight-decay", "0.1")
        configs = RunConfigs.from_args(args)
        megatron = sched(argparse.Namespace(**vars(args)), get_optimizer_param_scheduler)
        ours = sched(configs.schedule, build_param_scheduler)
        assert ours == megatron
        assert (ours["lr_warmup_steps"], ours["lr_decay_steps"], ours["wd_incr_steps"]) == steps
        record_run_length(args)
        assert {k: getattr(args, k) for k in written} == written
