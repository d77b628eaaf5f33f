"""Megatron's ``args``-taking checkpoint functions, for users' scripts: ``save_checkpoint(iteration, model, optimizer,
opt_param_scheduler)``, ``load_checkpoint(model, optimizer, opt_param_scheduler, load_arg='load', strict=True)``,
``load_args_from_checkpoint(args)``, ``check_checkpoint_args``, and the architecture check on a namespace. Each builds
the records it needs from ``args`` (default: the global flags, `get_args`) and calls the run-time layer in
megatron/checkpoint/, which takes records and state only (`write_checkpoint`, `read_checkpoint`,
`check_checkpoint_layout`, `restored_flag_values`, `compare_architecture`).

Megatron's import path ``megatron.checkpointing`` is this module (megatron/moved.py), so it also names the run-time
layer's public functions Megatron's module had (`get_checkpoint_name`, `read_metadata`, `get_rng_state`, ...); our
own code imports those from where they are defined. Above the driver: nothing in megatron/ imports this module.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Mapping, Optional

import torch

from megatron.checkpoint.args import architecture_changes, checkpoint_flag_values, compare_architecture
from megatron.checkpoint.async_save import maybe_finalize as maybe_finalize_async_save
from megatron.checkpoint.loading import LoadedCheckpoint, forget_last_loaded, last_loaded, read_checkpoint
from megatron.checkpoint.paths import (
    CHECKPOINT_VERSION,
    TRACKER_FILENAME,
    CheckpointError,
    first_failure_reason,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    get_distributed_optimizer_checkpoint_name,
    load_state_dict_file,
    model_file_name,
    read_metadata,
    reshard_hint,
)
from megatron.checkpoint.rng import get_rng_state, local_rng_state, restore_local_rng_state, set_rng_state
from megatron.checkpoint.saving import save_run_checkpoint, write_checkpoint
from megatron.checkpoint.selection import check_checkpoint_layout, restored_flag_values
from megatron.global_vars import get_args
from megatron.run_configs.architecture import architecture_from_args
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.training_state import TrainingState

__all__ = [
    "CHECKPOINT_VERSION", "TRACKER_FILENAME", "CheckpointError", "LoadedCheckpoint", "args_to_save",
    "check_architecture", "check_checkpoint_args", "check_checkpoint_layout", "first_failure_reason",
    "forget_last_loaded", "get_checkpoint_name", "get_checkpoint_tracker_filename",
    "get_distributed_optimizer_checkpoint_name", "get_rng_state", "last_loaded", "load_args_from_checkpoint",
    "load_checkpoint", "load_state_dict_file", "local_rng_state", "maybe_finalize_async_save", "model_file_name", "read_checkpoint",
    "read_metadata", "reshard_hint", "restore_architecture", "restore_local_rng_state", "save_checkpoint",
    "save_run_checkpoint", "set_rng_state", "use_checkpoint_args", "write_checkpoint",
]


def args_to_save(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of args without values that cannot be pickled (e.g. callables set at run time)."""
    keep = {}
    for key, value in vars(args).items():
        if callable(value) and not isinstance(value, torch.dtype):
            continue
        keep[key] = value
    return argparse.Namespace(**keep)


def _set_flags(args: argparse.Namespace, values: Mapping[str, Any]) -> None:
    """--use-checkpoint-args' flag values written onto Megatron's namespace (the one write of this module)."""
    for dest, value in values.items():
        setattr(args, dest, value)


def save_checkpoint(
    iteration: int,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    args: Optional[argparse.Namespace] = None,
    save_dir: Optional[str] = None,
    train_loss: Optional[float] = None,
    train_state: Optional[TrainingState] = None,
    settings: Optional[CheckpointSettings] = None,
) -> str:
    """Megatron's ``save_checkpoint(iteration, model, optimizer, opt_param_scheduler)``: `write_checkpoint` with the
    records built from ``args`` (default: the global flags). `train_state`: the run state (saved as Megatron's keys and
    inside ``args``); without it, the run state is read from ``args`` under Megatron's names. `settings` (default:
    built from ``args``) says what to save and where."""
    if args is None:
        args = get_args()
    run = train_state if train_state is not None else TrainingState.from_args(args)
    saved_args = args_to_save(args) if train_state is None else train_state.megatron_args(args)
    cfg = settings if settings is not None else CheckpointSettings.from_args(args)
    return write_checkpoint(iteration, model, optimizer, opt_param_scheduler, cfg, architecture_from_args(args),
                            saved_args, run, save_dir=save_dir, train_loss=train_loss)


def load_checkpoint(
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    args: Optional[argparse.Namespace] = None,
    load_arg: str = "load",
    strict: bool = True,
    train_state: Optional[TrainingState] = None,
    settings: Optional[CheckpointSettings] = None,
) -> int:
    """Megatron's ``load_checkpoint(model, optimizer, opt_param_scheduler, load_arg='load', strict=True)``:
    `read_checkpoint` with the records built from ``args`` (default: the global flags) and ``load_arg``.

    The consumed train/valid samples go to `train_state`; without one, onto ``args`` (Megatron's names). `settings`
    (default: built from ``args`` and ``load_arg``) says what to load."""
    if args is None:
        args = get_args()
    cfg = settings if settings is not None else CheckpointSettings.from_args(args, load_arg)
    run = train_state if train_state is not None else TrainingState()
    on_restored = None if train_state is not None else \
        (lambda restored, names: restored.write_counters(args, names))
    return read_checkpoint(model, optimizer, opt_param_scheduler, cfg, architecture_from_args(args), run,
                           strict=strict, on_restored=on_restored)


def check_checkpoint_args(checkpoint_args: argparse.Namespace, args: argparse.Namespace, path: str,
                          architecture: Optional[dict] = None, settings: Optional[CheckpointSettings] = None) -> None:
    """One-line error when the checkpoint's parallel layout or architecture (stored ``architecture``, else computed
    from its saved args) differs from this run (``args``; its parallel sizes from `settings` when given)."""
    cfg = settings if settings is not None else CheckpointSettings.from_args(args)
    check_checkpoint_layout(checkpoint_args, cfg, architecture_from_args(args), path, architecture)


def load_args_from_checkpoint(args: argparse.Namespace, load_arg: str = "load") -> argparse.Namespace:
    """--use-checkpoint-args: restore the whole architecture saved in the checkpoint that load_checkpoint will load
    (the tracker's iteration, or the newest intact one below it) into ``args``."""
    _set_flags(args, restored_flag_values(CheckpointSettings.from_args(args, load_arg), vars(args)))
    return args


def check_architecture(saved: Mapping[str, Any], args: argparse.Namespace, path: str) -> None:
    """One line naming the first field where the checkpoint and this run's flags differ, with both values."""
    compare_architecture(saved, architecture_from_args(args), path)


def restore_architecture(args: argparse.Namespace, saved: Mapping[str, Any],
                         ckpt_args: Optional[argparse.Namespace], defaults: Mapping[str, Any]) -> List[str]:
    """--use-checkpoint-args onto ``args``: `architecture_changes` set on it; returns the destinations set."""
    changes: Dict[str, Any] = architecture_changes(vars(args), saved, ckpt_args, defaults)
    _set_flags(args, changes)
    return sorted(changes)


def use_checkpoint_args(args: argparse.Namespace, state_dict: Mapping[str, Any]) -> List[str]:
    """--use-checkpoint-args from a loaded checkpoint file: restore its whole architecture into `args`."""
    changes = checkpoint_flag_values(state_dict, vars(args))
    _set_flags(args, changes)
    return sorted(changes)

