"""Write a training checkpoint in Megatron-LM's layout (megatron/checkpoint/paths.py) from the run's records and
state.

Each file holds ``args``, ``checkpoint_version`` (3.0), ``iteration``, ``model`` (the nested
``state_dict_for_save_checkpoint()``; ``model0``, ``model1`` … with virtual pipeline chunks), ``optimizer``,
``opt_param_scheduler`` (and its old name ``lr_scheduler``), ``rng_state`` (one entry per data-parallel rank),
consumed samples/tokens and the true/padded vocabulary sizes. Only data-parallel rank 0 writes; every file is
written to a temporary name and renamed, and the tracker file is written last, so a crash never leaves a
half-written checkpoint that looks complete. Under expert parallelism expert-data-parallel rank 0 of every expert rank
writes its folder (the dense weights and its own experts), as Megatron-LM does.

With ``--use-distributed-optimizer`` the sharded optimizer state goes to ``distrib_optim.pt`` next to
``model_optim_rng.pt`` (whose ``optimizer`` entry keeps the non-sharded part: param-group hyperparameters and the
grad scaler). The data-parallel shards are gathered to data-parallel rank 0 of each model-parallel rank, which writes
the full fp32 params and optimizer state per parameter (megatron/checkpoint/loading.py converts it on load).

With ``--async-save`` each rank's state is copied and written in the background (the copy during the next forward and
backward passes; the optimizer step waits for it), and rank 0 publishes the checkpoint (torch_dist rewrite, manifest,
tracker) once every rank's files are complete (megatron/checkpoint/async_save.py).
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from megatron.checkpoint import async_save, expert_shards, integrity
from megatron.checkpoint.atomic_io import atomic_torch_save, atomic_write_text
from megatron.checkpoint.formats import rewrite_as_torch_dist
from megatron.checkpoint.paths import (
    CHECKPOINT_VERSION,
    CheckpointError,
    barrier,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    get_distributed_optimizer_checkpoint_name,
    is_rank0,
    print0,
)
from megatron.checkpoint.rng import get_rng_state
from megatron.core import parallel_state as ps
from megatron.layers.module import unwrap_model
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.training_state import TrainingState

if TYPE_CHECKING:
    from megatron.run_configs.bundle import RunConfigs


def model_chunks(model: Any) -> list[torch.nn.Module]:
    """The model as a list of chunks (one, or one per virtual pipeline stage)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def model_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """A model chunk's checkpoint entry: Megatron's nested ``state_dict_for_save_checkpoint()``, else ``state_dict()``."""
    module = unwrap_model(module)
    if hasattr(module, "state_dict_for_save_checkpoint"):
        return module.state_dict_for_save_checkpoint()
    return module.state_dict()


def save_run_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
                        train_state: TrainingState, train_loss: Optional[float] = None, sign: bool = True) -> str:
    """The training loop's save: the run's records and state (Megatron's ``args`` derived from the flags and the
    state, `TrainingState.megatron_args`); `sign=False`: without manifest.json."""
    return write_checkpoint(iteration, model, optimizer, opt_param_scheduler, configs.checkpoint,
                            configs.architecture, train_state.megatron_args(configs.flags), train_state,
                            train_loss=train_loss, sign=sign)


def _rank_state_dict(iteration: int, models: list, model_sds: Optional[list], optim: tuple, cfg: CheckpointSettings,
                     architecture: Mapping[str, Any], saved_args: argparse.Namespace, run: TrainingState,
                     train_loss: Optional[float], rng_state: Any) -> dict[str, Any]:
    """This rank's checkpoint file contents (Megatron's keys); `optim` is (optimizer, its gathered state or None,
    the LR scheduler)."""
    optimizer, optim_sd, opt_param_scheduler = optim
    state_dict: dict[str, Any] = {
        "args": saved_args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        **run.checkpoint_counters(),
        "true_vocab_size": cfg.true_vocab_size,
        "padded_vocab_size": run.padded_vocab_size,
        "architecture": dict(architecture),
        **run.checkpoint_totals(),
    }
    if train_loss is not None:
        state_dict["train_loss"] = float(train_loss)
    model_sds = model_sds or [model_state_dict(chunk) for chunk in models]
    if len(models) == 1:
        state_dict["model"] = model_sds[0]
    else:
        for i, chunk_sd in enumerate(model_sds):
            state_dict[f"model{i}"] = chunk_sd
    if not cfg.no_save_optim:
        if optimizer is not None:
            state_dict["optimizer"] = optim_sd if optim_sd is not None else optimizer.state_dict()
        if opt_param_scheduler is not None:
            sched = opt_param_scheduler.state_dict()
            state_dict["opt_param_scheduler"] = sched
            state_dict["lr_scheduler"] = sched
    if rng_state is not None:
        state_dict["rng_state"] = rng_state
    return state_dict


def write_checkpoint(
    iteration: int,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    cfg: CheckpointSettings,
    architecture: Mapping[str, Any],
    saved_args: argparse.Namespace,
    run: TrainingState,
    save_dir: Optional[str] = None,
    train_loss: Optional[float] = None,
    sign: bool = True,
) -> str:
    """Write the checkpoint of ``iteration`` into ``save_dir`` (default ``cfg.save``); returns this rank's file.
    `train_loss` (the last finite training loss, summed over its terms) is recorded for the check after loading.
    `sign=False`: no manifest.json (a later load treats it as unverified) and no --keep-last-n-checkpoints pruning.
    `saved_args` is stored as Megatron's ``args``, `architecture` as ours, `run`'s counters as Megatron's keys."""
    save_dir = save_dir or cfg.save
    if not save_dir:
        raise CheckpointError("save_checkpoint called without a directory: pass --save DIR")
    async_save.maybe_finalize(blocking=True)  # --async-save: the previous save is published first
    state = ps.current_parallel_state()
    models = model_chunks(model)
    print0(f"saving checkpoint at iteration {iteration:7d} to {save_dir}")
    iter_dir = os.path.dirname(os.path.dirname(get_checkpoint_name(save_dir, iteration)))
    if is_rank0():  # before anyone writes: crashed writes' temp files go, a rewritten iteration must not verify
        integrity.prepare_save(save_dir, iter_dir, print0)
    barrier()

    rng_state = None if cfg.no_save_rng else get_rng_state(state)
    checkpoint_name = get_checkpoint_name(save_dir, iteration)
    for chunk in models:  # --overlap-param-gather: the params' all-gather may still be in flight
        getattr(chunk, "finish_param_sync", lambda: None)()
    param_state = None
    if optimizer is not None and hasattr(optimizer, "get_parameter_state") and not cfg.no_save_optim:
        param_state = optimizer.get_parameter_state()  # collective over the data-parallel group
    model_sds = optim_sd = None
    if expert_shards.active(state):  # expert-TP > 1 != TP: the experts are saved whole (collective over expert-TP)
        whole = expert_shards.gather(state)
        model_sds = [expert_shards.model_state(model_state_dict(chunk), models, whole) for chunk in models]
        if param_state is not None:
            param_state = expert_shards.param_state(param_state, whole, models)
        elif optimizer is not None and not cfg.no_save_optim:
            optim_sd = expert_shards.regular_optimizer_state(optimizer.state_dict(), models, whole)
    elif optimizer is not None and getattr(optimizer, "state_dict_is_collective", False) and not cfg.no_save_optim:
        optim_sd = optimizer.state_dict()  # --optimizer dist_muon: the owners' state gathered on every rank
    writer = state.writes_checkpoint
    if writer is None:  # a state built by hand: Megatron-LM's rule
        writer = (state.edp_rank if state.ep_size > 1 else state.dp_rank) == 0
    writes: list[tuple[Any, str]] = []
    if writer and state.cp_rank == 0:  # one writer per model-parallel (and expert) rank folder
        # (parallel_state.checkpoint_writer); context-parallel ranks hold the same weights
        writes.append((_rank_state_dict(iteration, models, model_sds, (optimizer, optim_sd, opt_param_scheduler),
                                        cfg, architecture, saved_args, run, train_loss, rng_state), checkpoint_name))
        if param_state is not None:
            writes.append((param_state, get_distributed_optimizer_checkpoint_name(checkpoint_name)))
    publish = functools.partial(_publish, save_dir, iteration, iter_dir, cfg,
                                optimizer is not None and not cfg.no_save_optim, sign)
    if cfg.async_save:  # copied and written in the background (what changes the state first waits for the copy);
        # published once every rank's files are complete
        async_save.schedule(iteration, writes, atomic_torch_save, publish if is_rank0() else None,
                            cfg.use_persistent_ckpt_worker)
        print0(f"  writing the checkpoint of iteration {iteration:7d} in the background (--async-save)")
        return checkpoint_name
    for obj, path in writes:
        atomic_torch_save(obj, path)
    barrier()
    if is_rank0():
        publish()
    barrier()
    return checkpoint_name


def _publish(save_dir: str, iteration: int, iter_dir: str, cfg: CheckpointSettings, optimizer_saved: bool,
             sign: bool) -> None:
    """Rank 0, once every rank's files of `iteration` are complete: the torch_dist rewrite, the manifest (written
    last of the iteration), then the tracker moves; --keep-last-n-checkpoints."""
    if cfg.ckpt_format == "torch_dist":  # the per-rank files just written become one torch_dist folder (any layout
        rewrite_as_torch_dist(save_dir, iteration, iter_dir, optimizer=optimizer_saved)  # loads it)
    if sign:
        integrity.write_manifest(iter_dir)
    atomic_write_text(get_checkpoint_tracker_filename(save_dir), str(iteration))
    if sign:
        integrity.prune_after_save(save_dir, iteration, cfg.keep_last_n_checkpoints, print0)
    print0(f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir}")
