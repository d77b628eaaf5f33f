"""Load a training checkpoint into the model, optimizer and LR scheduler from the run's records and state: the
iteration `selection.py` picks (or another layout through megatron/checkpoint/formats.py), the model chunks' weights
(old QKV row orders reordered, expert-TP slices taken), the optimizer state (the distributed optimizer's
``distrib_optim.pt`` and the regular layout convert into each other, so a run resumes at another data-parallel size),
the consumed samples and the RNG states; `last_loaded` records what was read (training's divergence checks).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Mapping, Optional

from megatron.checkpoint import expert_shards, integrity
from megatron.checkpoint.conversion.qkv_versions import fix_state_dict_qkv, has_qkv
from megatron.checkpoint.formats import TORCH, load_foreign
from megatron.checkpoint.paths import (
    CheckpointError,
    barrier,
    get_checkpoint_tracker_filename,
    get_distributed_optimizer_checkpoint_name,
    load_state_dict_file,
    print0,
    read_metadata,
    reshard_hint,
)
from megatron.checkpoint.rng import set_rng_state
from megatron.checkpoint.saving import model_chunks
from megatron.checkpoint.selection import check_checkpoint_layout, select_checkpoint, verified_foreign_folder
from megatron.core import parallel_state as ps
from megatron.layers.module import unwrap_model
from megatron.optimizer.distrib_optimizer import param_state_to_regular_state, regular_state_to_param_state
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.training_state import COUNTERS, TrainingState


def _qkv_in_current_order(model_sd: dict, sd: dict, cfg: CheckpointSettings) -> dict:
    """Megatron's fix_query_key_value_ordering: checkpoint_version 0 / 1.0 QKV rows -> today's [heads, 3, d]."""
    version = float(sd.get("checkpoint_version", 0) or 0)
    if version >= 2.0 or cfg.qkv_heads_per_rank is None:
        return model_sd
    if not has_qkv(model_sd):
        return model_sd

    print0(f" reordering the query_key_value rows of a checkpoint_version {version} checkpoint")
    return fix_state_dict_qkv(model_sd, version, cfg.qkv_heads_per_rank, cfg.qkv_head_dim)


@dataclasses.dataclass
class LoadedCheckpoint:
    """What the last load_checkpoint of this process read (training's divergence checks use it)."""

    folder: str  # the iteration folder
    iteration: int
    verified: bool  # False: it had no manifest.json and was loaded unverified
    train_loss: Optional[float]  # the loss recorded when it was saved (None for older checkpoints)


_LAST_LOADED: Optional[LoadedCheckpoint] = None


def last_loaded() -> Optional[LoadedCheckpoint]:
    """What the last `read_checkpoint` of this process read (None: nothing loaded yet, or started from scratch)."""
    return _LAST_LOADED


def forget_last_loaded() -> None:
    """Clear `last_loaded` (a new load, or a new run in the same process)."""
    global _LAST_LOADED
    _LAST_LOADED = None


def _load_other_format(models: list, cfg: CheckpointSettings, architecture: Mapping[str, Any], iteration: int,
                       release: bool, state: ps.ParallelState, run: TrainingState, optimizer: Any = None,
                       opt_param_scheduler: Any = None,
                       on_restored: Optional[Callable[[TrainingState, tuple], None]] = None) -> Optional[int]:
    """Megatron Core layouts (per-rank files with Core names, torch_dist): load their weights (and a torch_dist
    folder's training state) at this run's layout (megatron/checkpoint/formats.py) and return the iteration; None for
    our own layout. The folder is verified first (`verified_foreign_folder`) and recorded for `last_loaded`."""
    selected = verified_foreign_folder(cfg, iteration, release)
    if selected is None:
        return None
    fmt, iter_dir, verified = selected
    if fmt == TORCH:
        return None
    iteration, common, rng = load_foreign(models, cfg, architecture, cfg.load, iter_dir, fmt, release, state, run,
                                          optimizer, opt_param_scheduler, on_restored)
    global _LAST_LOADED
    loss = common.get("train_loss")
    _LAST_LOADED = LoadedCheckpoint(folder=iter_dir, iteration=iteration, verified=verified,
                                    train_loss=float(loss) if isinstance(loss, (int, float)) else None)
    if rng is not None:
        set_rng_state(rng, state)
    barrier()
    print0(f"  successfully loaded checkpoint from {cfg.load} at iteration {iteration}")
    return iteration


def _load_model_weights(models: list, sd: dict, checkpoint_name: str, ckpt_args: Any, cfg: CheckpointSettings,
                        state: Any, strict: bool) -> bool:
    """Load every model chunk's weights from `sd`; returns whether the experts were saved whole (expert-TP)."""
    # Model weights (expert-TP > 1 != TP: the checkpoint's experts are whole, this rank takes its slice).
    experts_whole = expert_shards.active(state)
    if experts_whole and ckpt_args is not None and not expert_shards.saved_whole(ckpt_args):
        raise CheckpointError(f"checkpoint {checkpoint_name} holds its experts split over its TP ranks, this run "
                              f"splits them over --expert-tensor-parallel-size {state.etp_size}: "
                              f"{reshard_hint(cfg.load)}, then load it with the expert-TP size it was converted to")
    for i, chunk in enumerate(models):
        key = "model" if len(models) == 1 else f"model{i}"
        if key not in sd:
            raise CheckpointError(f"checkpoint {checkpoint_name} has no '{key}' entry (saved with a different "
                               "--virtual-pipeline-model-parallel-size?)")
        model_sd = sd[key]
        if experts_whole:
            model_sd = expert_shards.model_state(model_sd, models, expert_shards.take_slice(state))
        try:
            unwrap_model(chunk).load_state_dict(_qkv_in_current_order(model_sd, sd, cfg), strict=strict)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()
            detail = " ".join(line.strip() for line in first[1:3]) if len(first) > 1 else first[0]
            raise CheckpointError(
                f"checkpoint {checkpoint_name} does not match the model ({detail[:300]}); check --num-layers, "
                "--hidden-size, --num-attention-heads, --vocab-file and the parallel sizes"
            ) from None
    return experts_whole


def _load_optimizer_state(optimizer: Any, opt_param_scheduler: Any, sd: dict, models: list, checkpoint_name: str,
                          cfg: CheckpointSettings, weights_only: bool, experts_whole: bool) -> None:
    """Load the optimizer and LR scheduler state (not for --finetune or a release checkpoint: `weights_only`,
    nor with --no-load-optim); without it, fp32 main params follow the loaded weights."""
    # Optimizer and LR scheduler.
    loaded_optim = False
    if not weights_only and not cfg.no_load_optim:
        if optimizer is not None:
            if "optimizer" not in sd:
                raise CheckpointError(f"checkpoint {checkpoint_name} has no optimizer state; pass --no-load-optim")
            _load_optimizer(optimizer, sd["optimizer"], models, checkpoint_name, cfg.trust_checkpoint, experts_whole)
            loaded_optim = True
        if opt_param_scheduler is not None:
            sched = sd.get("opt_param_scheduler", sd.get("lr_scheduler"))
            if sched is not None:
                opt_param_scheduler.load_state_dict(sched)
    if optimizer is not None and not loaded_optim and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 main params must follow the loaded fp16/bf16 weights


def _load_optimizer(optimizer: Any, optim_sd: dict, models: list, checkpoint_name: str, trust: bool = False,
                    experts_whole: bool = False) -> None:
    """Load the optimizer state; converts between the distributed optimizer's layout (``distrib_optim.pt``) and the
    regular one in either direction (the saved state is complete per parameter). `experts_whole`: the checkpoint
    holds the experts whole and this rank takes its expert-TP slice (megatron/checkpoint/expert_shards.py)."""
    saved_distributed = isinstance(optim_sd, dict) and bool(optim_sd.get("distributed_optimizer", False))
    is_distributed = hasattr(optimizer, "load_parameter_state")
    param_state = None
    if saved_distributed:
        path = get_distributed_optimizer_checkpoint_name(checkpoint_name)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {checkpoint_name} was saved with --use-distributed-optimizer but "
                                  f"{path} is missing; restore it or pass --no-load-optim")
        param_state = load_state_dict_file(path, trust)
        if experts_whole:
            param_state = expert_shards.param_state(param_state, expert_shards.take_slice(ps.current_parallel_state()), models)
    elif experts_whole:
        optim_sd = expert_shards.regular_optimizer_state(optim_sd, models, expert_shards.take_slice(ps.current_parallel_state()))
    try:
        if is_distributed:
            optimizer.load_state_dict(optim_sd)
            if param_state is None:
                print0(" converting the regular optimizer state of the checkpoint for --use-distributed-optimizer")
                param_state = regular_state_to_param_state(optim_sd, models)
            optimizer.load_parameter_state(param_state)
        elif saved_distributed:
            print0(" converting the checkpoint's --use-distributed-optimizer state for the regular optimizer")
            optimizer.load_state_dict(param_state_to_regular_state(param_state, optim_sd, models, optimizer))
        else:
            optimizer.load_state_dict(optim_sd)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot load the optimizer state of {checkpoint_name}: {exc}") from None


def read_checkpoint(
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    cfg: CheckpointSettings,
    architecture: Mapping[str, Any],
    run: TrainingState,
    strict: bool = True,
    on_restored: Optional[Callable[[TrainingState, tuple], None]] = None,
) -> int:
    """Load the latest checkpoint under ``cfg.load``; returns the iteration to continue from.

    Honours --finetune (model only, iteration 0), --no-load-optim, --no-load-rng and ``release`` checkpoints,
    restores the consumed train/valid samples into `run` (then calls ``on_restored(run, names)``). No tracker file
    → start from scratch (0). The checkpoint's layout and architecture are checked against `cfg` and `architecture`
    (this run's).
    """
    forget_last_loaded()
    load_dir = cfg.load
    if not load_dir:
        return 0
    state = ps.current_parallel_state()
    models = model_chunks(model)
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        if cfg.exit_on_missing_checkpoint:
            raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint ({tracker}) in --load {load_dir}")
        print0(f" no checkpoint in {load_dir} yet ({os.path.basename(tracker)} not found): will not load any "
                "checkpoints and will start from random")
        return 0
    iteration, release = read_metadata(tracker)
    trust = cfg.trust_checkpoint
    foreign = _load_other_format(models, cfg, architecture, iteration, release, state, run, optimizer,
                                 opt_param_scheduler, on_restored)
    if foreign is not None:
        return foreign
    iteration, checkpoint_name, sd = select_checkpoint(load_dir, iteration, release, trust,
                                                        not cfg.no_checkpoint_fallback)
    print0(f" loading checkpoint from {load_dir} at iteration {iteration}")
    finetune = cfg.finetune
    global _LAST_LOADED
    _LAST_LOADED = LoadedCheckpoint(folder=os.path.dirname(os.path.dirname(checkpoint_name)), iteration=iteration,
                                    verified=integrity.verify(os.path.dirname(os.path.dirname(checkpoint_name)), [])
                                    != integrity.NO_MANIFEST,
                                    train_loss=sd.get("train_loss") if isinstance(sd.get("train_loss"), float) else None)

    ckpt_args = sd.get("args")
    if ckpt_args is not None or sd.get("architecture"):
        check_checkpoint_layout(ckpt_args, cfg, architecture, checkpoint_name, sd.get("architecture"))
    loaded_iteration = iteration
    if finetune or release:
        iteration = 0
    else:
        iteration = int(sd.get("iteration", sd.get("total_iters", 0)))
        run.restore_counters(sd, ckpt_args)
        if on_restored is not None:
            on_restored(run, COUNTERS)

    experts_whole = _load_model_weights(models, sd, checkpoint_name, ckpt_args, cfg, state, strict)
    _load_optimizer_state(optimizer, opt_param_scheduler, sd, models, checkpoint_name, cfg, release or finetune,
                          experts_whole)

    # RNG.
    if not release and not finetune and not cfg.no_load_rng:
        if "rng_state" not in sd:
            raise CheckpointError(f"checkpoint {checkpoint_name} has no rng_state; pass --no-load-rng")
        set_rng_state(sd["rng_state"], state)

    barrier()
    restart = "" if iteration == loaded_iteration else \
        f"; training starts at iteration {iteration} ({'--finetune' if finetune else 'a release checkpoint'})"
    print0(f"  successfully loaded checkpoint from {load_dir} at iteration {loaded_iteration}{restart}")
    sys.stdout.flush()
    return iteration
