"""Start-up as one pipeline: each step a function that returns a value, run once, in order, by initialize_megatron.

    parse -> restore checkpoint args -> validate (DeepSpeed reconciled at its point) -> tokenizer -> records

1. `parse`: Megatron's flags (plus an entry script's extra groups), and where this process sits in the job.
2. `restore_checkpoint_args`: with --use-checkpoint-args, a new namespace holding the checkpoint's architecture.
3. `validate`: a new namespace with every derived value Megatron's validation fills (data_parallel_size,
   params_dtype, ffn_hidden_size, ...); its input is never changed. Under --deepspeed, validation calls the
   `reconcile_deepspeed` step where Megatron-DeepSpeed settles the config (after the batch sizes, before the
   precision checks that follow from it), so the log lines and the argument dump stay Megatron-DeepSpeed's.
4. `tokenizer`: (tokenizer, padded vocabulary size); nothing is written onto the flags.
5. `records`: Megatron's ``args`` namespace assembled once (validated flags + padded_vocab_size + the process's
   placement: rank, world_size, local_rank, distributed_backend), as a read-only `StartupArgs`.

`StartupArgs` is what `get_args()` returns. Our own code (megatron/, tasks/, tools/, pretrain_*.py) never writes onto it:
a write from there raises `ArgsReadOnlyError`, except the names Megatron's set-up records on ``args`` after
start-up (`RECORDED_AFTER_START_UP`: the model type, the run's length, the consumed samples a loaded checkpoint
restores). Users' scripts keep Megatron's contract: ``get_args().x = ...`` from a module of theirs works.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from megatron.arguments import parse_args, validated_args
from megatron.checkpoint.selection import restored_flag_values
from megatron.ds.config import reconcile_deepspeed_config
from megatron.errors import MegatronUserError
from megatron.global_vars import build_num_microbatches_calculator_from, install_global_variables
from megatron.launcher import detect_launcher_env
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.run_configs.tokenizer import TokenizerSettings
from megatron.tokenizer.abstract import AbstractTokenizer
from megatron.tokenizer.tokenizer import build_tokenizer_from, padded_vocab_size

# Megatron's own set-up records these on ``args`` after start-up (get_model: model_type; the LR scheduler's builder:
# the run's length; load_checkpoint: the consumed samples), and its tools read them back from there.
RECORDED_AFTER_START_UP = frozenset({
    "model_type", "train_iters", "lr_decay_iters", "lr_decay_samples",
    "consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens", "consumed_valid_tokens",
})
# The writers a StartupArgs refuses: our packages, and our tools and entry scripts (run as __main__); users' modules
# and scripts may write.
OUR_PACKAGES = ("megatron", "tasks", "tools")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OUR_FOLDERS = tuple(os.path.join(_ROOT, name) + os.sep for name in OUR_PACKAGES)


class ArgsReadOnlyError(MegatronUserError, AttributeError):
    """Our code wrote onto the args start-up assembled."""


def writer_is_ours(module: str, path: str) -> bool:
    """Whether code of `module` (its __name__) in the file `path` is ours: megatron/, tasks/, tools/ or one of the
    pretrain_*.py entry scripts beside them."""
    path = os.path.abspath(path)
    return module.split(".", 1)[0] in OUR_PACKAGES or path.startswith(_OUR_FOLDERS) or \
        (os.path.dirname(path) == _ROOT and os.path.basename(path).startswith("pretrain_"))


def _writer_is_ours(depth: int = 2) -> bool:
    frame = sys._getframe(depth)
    return writer_is_ours(frame.f_globals.get("__name__", ""), frame.f_code.co_filename)


class StartupArgs(argparse.Namespace):
    """Megatron's ``args`` as start-up leaves it: read-only for our code, writable for users' scripts (above)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in RECORDED_AFTER_START_UP and _writer_is_ours():
            raise ArgsReadOnlyError(
                f"args.{name} is read-only after start-up (megatron/startup.py): derive the value in a start-up step "
                "or keep it in a record of its own")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if _writer_is_ours():
            raise ArgsReadOnlyError(f"args.{name} cannot be deleted after start-up (megatron/startup.py)")
        super().__delattr__(name)


def read_only_args(values: Mapping[str, Any]) -> StartupArgs:
    """A `StartupArgs` holding `values` in their order (the order Megatron's ``args`` has, saved in checkpoints)."""
    out = StartupArgs()
    out.__dict__.update(values)
    return out


# --------------------------------------------------------------------------------------------------------- the steps
def parse(extra_args_provider: Optional[Callable] = None, ignore_unknown_args: bool = False,
          argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Step 1: the flags as parsed, with `rank`/`world_size` from the launcher (Megatron's parse_args)."""
    return parse_args(extra_args_provider, ignore_unknown_args, argv)


def restore_checkpoint_args(parsed: argparse.Namespace, defaults: Mapping[str, Any]) -> argparse.Namespace:
    """Step 2: with --use-checkpoint-args, a copy of `parsed` with the architecture saved in --load's checkpoint."""
    if not (getattr(parsed, "use_checkpoint_args", False) or defaults.get("use_checkpoint_args", False)):
        return parsed
    if not parsed.load:
        raise ValueError("--use-checkpoint-args needs --load <checkpoint directory>")
    given = vars(parsed)
    return argparse.Namespace(**{**given, **restored_flag_values(CheckpointSettings.from_args(parsed), given)})


def reconcile_deepspeed(args: argparse.Namespace) -> Mapping[str, Any]:
    """Step 3b (under --deepspeed, called by validation): the flag values the DeepSpeed config settles, in the
    order Megatron-DeepSpeed records them (megatron/ds/config.py)."""
    return reconcile_deepspeed_config(args).settled_values()


def validate(restored: argparse.Namespace, defaults: Mapping[str, Any]) -> argparse.Namespace:
    """Step 3: a new namespace with Megatron's checks passed and its derived values filled (`restored` unchanged)."""
    return validated_args(restored, dict(defaults), reconcile_deepspeed)


def tokenizer(validated: argparse.Namespace) -> Tuple[Optional[AbstractTokenizer], Optional[int]]:
    """Step 4: the tokenizer named by --tokenizer-type and the padded vocabulary size (without a tokenizer type:
    --vocab-size padded, if given). Prints Megatron's lines on rank 0."""
    settings = TokenizerSettings.from_args(validated)
    if settings.tokenizer_type is not None:
        return build_tokenizer_from(settings)
    known = getattr(validated, "padded_vocab_size", None)
    if known is None and settings.vocab_size is not None:
        return None, padded_vocab_size(settings.vocab_size, settings)
    return None, known


def placement(validated: argparse.Namespace) -> Dict[str, Any]:
    """Where this process sits, as Megatron records it on ``args`` once torch.distributed is up: rank, world_size,
    local_rank (from the launcher when we start the process group) and the backend."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return {"rank": torch.distributed.get_rank(), "world_size": torch.distributed.get_world_size(),
                "distributed_backend": torch.distributed.get_backend()}
    env = detect_launcher_env(os.environ)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    return {"rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
            "distributed_backend": resolve_backend(validated.distributed_backend, cuda)}


def resolve_backend(requested: Optional[str], cuda_available: bool) -> str:
    """nccl with CUDA, gloo without; an explicit --distributed-backend wins (nccl without CUDA is refused)."""
    if requested is None:
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise RuntimeError("--distributed-backend nccl needs CUDA GPUs, none found; use --distributed-backend gloo")
    if requested not in ("nccl", "gloo"):
        raise ValueError(f"--distributed-backend must be nccl or gloo (got {requested!r})")
    return requested


def records(validated: argparse.Namespace, padded: Optional[int], placed: Mapping[str, Any],
            lazy_mpu_init: bool = False) -> StartupArgs:
    """Step 5: Megatron's ``args``, assembled once: the validated flags, padded_vocab_size, the placement (and,
    with --lazy-mpu-init, CPU initialisation), in the order Megatron's start-up leaves them."""
    values = dict(vars(validated))
    if padded is not None:
        values["padded_vocab_size"] = padded
    values.update(placed)
    if lazy_mpu_init:
        values["use_cpu_initialization"] = True  # the caller (an external framework) finishes start-up later
    return read_only_args(values)


def run(extra_args_provider: Optional[Callable] = None, args_defaults: Optional[Mapping[str, Any]] = None,
        ignore_unknown_args: bool = False, argv: Optional[List[str]] = None,
        skip_mpu_initialization: bool = False) -> StartupArgs:
    """The pipeline, once: returns Megatron's ``args`` and installs the globals (get_args(), get_tokenizer(),
    the micro-batch calculator, timers, tensorboard writer)."""
    defaults = dict(args_defaults or {})
    validated = validate(restore_checkpoint_args(parse(extra_args_provider, ignore_unknown_args, argv), defaults),
                         defaults)
    calculator = build_num_microbatches_calculator_from(validated)  # Megatron prints it before the tokenizer
    built, padded = tokenizer(validated)
    lazy = bool(getattr(validated, "lazy_mpu_init", False)) and not skip_mpu_initialization
    args = records(validated, padded, {} if skip_mpu_initialization else placement(validated), lazy)
    install_global_variables(args, built, calculator)
    return args
