"""Save and load training checkpoints in Megatron-LM's on-disk layout.

Layout (same as Megatron-LM, so its tools and ours read each other's folders)::

    <save>/latest_checkpointed_iteration.txt          "1000" or "release"
    <save>/iter_0001000/mp_rank_00/model_optim_rng.pt   (PP == 1)
    <save>/iter_0001000/mp_rank_00_000/model_optim_rng.pt (PP > 1: tensor rank, pipeline rank)
    <save>/iter_0001000/mp_rank_00[_000]_001/...          (expert parallelism: + expert rank, 3 digits)

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
the full fp32 params and optimizer state per parameter; on load every data-parallel rank reads it and takes its
slice, so a run can resume at another data-parallel size, and a regular checkpoint loads into the distributed
optimizer (and the other way round) by converting the full state.

Functions take the run's `CheckpointSettings` (megatron/run_configs/checkpoint.py) or build it from ``args`` (the
parsed Megatron flags, also the record saved in each file) explicitly instead of reading global state.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import numpy as np
import torch

from megatron.checkpoint import expert_shards, integrity
from megatron.checkpoint.args import (
    architecture_from_args,
    compare_architecture,
    deepspeed_state_file,
    saved_architecture,
    use_checkpoint_args,
)
from megatron.checkpoint.atomic_io import atomic_torch_save as _atomic_save
from megatron.checkpoint.atomic_io import atomic_write_text as _atomic_write_text
from megatron.checkpoint.conversion.interchange import ConversionError
from megatron.checkpoint.conversion.torch_dist import check_torch_dist, is_dist_folder, read_common
from megatron.checkpoint.formats import (
    TORCH,
    TORCH_DIST,
    CheckpointFormatError,
    check_format_flags,
    detect_format,
    load_foreign,
)
from megatron.checkpoint.safe_load import CheckpointFileError, safe_torch_load
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import get_rng_tracker
from megatron.errors import MegatronUserError
from megatron.layers.module import unwrap_model
from megatron.run_configs.checkpoint import PARALLEL_SIZE_FLAGS, CheckpointSettings
from megatron.training_state import COUNTERS, TrainingState

if TYPE_CHECKING:
    from megatron.run_configs.bundle import RunConfigs


class CheckpointError(MegatronUserError, RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit this run (the message names the flag to change)."""


CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"

# Parallel-layout flags that must agree between the checkpoint and this run (the architecture is checked by
# megatron/checkpoint/args.py).
_PARALLEL_ARGS = PARALLEL_SIZE_FLAGS


def reshard_hint(load_dir: str) -> str:
    """The command that changes a checkpoint's TP/PP sizes (with its optimizer state, so the run continues)."""
    if load_dir.endswith(".pt"):  # .../iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt -> the --load directory
        load_dir = os.path.dirname(os.path.dirname(os.path.dirname(load_dir)))
    return (f"reshard it: python tools/checkpoint/convert.py --model-type GPT --load-dir {load_dir} --save-dir NEW "
            "--target-tensor-parallel-size N --target-pipeline-parallel-size M, then --load NEW --no-load-rng "
            "(MoE: add --target-expert-parallel-size E to the convert.py command)")


def _print0(msg: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, flush=True)


def _state() -> ps.ParallelState:
    if ps.model_parallel_is_initialized():
        return ps.get_parallel_state()
    return ps.ParallelState.single()


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# ----------------------------------------------------------------------------------------------- paths
def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    """Path of the text file holding the latest saved iteration (or ``release``)."""
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def get_checkpoint_name(
    checkpoints_path: str,
    iteration: int,
    release: bool = False,
    pipeline_parallel: Optional[bool] = None,
    tensor_rank: Optional[int] = None,
    pipeline_rank: Optional[int] = None,
    expert_parallel: Optional[bool] = None,
    expert_rank: Optional[int] = None,
) -> str:
    """Megatron's ``.../iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` for this (or the
    given) rank."""
    state = _state()
    if pipeline_parallel is None:
        pipeline_parallel = state.pp_size > 1
    if expert_parallel is None:
        expert_parallel = state.ep_size > 1
    tensor_rank = state.tp_rank if tensor_rank is None else tensor_rank
    pipeline_rank = state.pp_rank if pipeline_rank is None else pipeline_rank
    expert_rank = state.ep_rank if expert_rank is None else expert_rank
    directory = "release" if release else f"iter_{iteration:07d}"
    rank_dir = f"mp_rank_{tensor_rank:02d}" + (f"_{pipeline_rank:03d}" if pipeline_parallel else "")
    rank_dir += f"_{expert_rank:03d}" if expert_parallel else ""
    return os.path.join(checkpoints_path, directory, rank_dir, "model_optim_rng.pt")


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name: str) -> str:
    """``distrib_optim.pt`` in the folder of ``model_optim_rng.pt`` (Megatron's name)."""
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


def model_file_name(checkpoint_name: str) -> str:
    """``model_optim_rng.pt``, or the ``model_rng.pt`` Megatron-LM writes beside a separate optimizer file."""
    alt = os.path.join(os.path.dirname(checkpoint_name), "model_rng.pt")
    return alt if not os.path.isfile(checkpoint_name) and os.path.isfile(alt) else checkpoint_name


def _qkv_in_current_order(model_sd: dict, sd: dict, cfg: CheckpointSettings) -> dict:
    """Megatron's fix_query_key_value_ordering: checkpoint_version 0 / 1.0 QKV rows -> today's [heads, 3, d]."""
    version = float(sd.get("checkpoint_version", 0) or 0)
    if version >= 2.0 or cfg.qkv_heads_per_rank is None:
        return model_sd
    from megatron.checkpoint.conversion.qkv_versions import fix_state_dict_qkv, has_qkv

    if not has_qkv(model_sd):
        return model_sd

    _print0(f" reordering the query_key_value rows of a checkpoint_version {version} checkpoint")
    return fix_state_dict_qkv(model_sd, version, cfg.qkv_heads_per_rank, cfg.qkv_head_dim)


def read_metadata(tracker_filename: str) -> tuple[int, bool]:
    """Read the tracker file: (iteration, release). One-line error when its content is not an integer/'release'."""
    try:
        text = integrity.read_pointer_file(tracker_filename)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(
            f"{tracker_filename} must contain an iteration number or 'release', found {text!r}; "
            "fix or delete the file"
        ) from None
    if iteration < 0:
        raise CheckpointError(f"{tracker_filename} holds a negative iteration ({iteration})")
    if torch.distributed.is_initialized():
        iters = torch.tensor([iteration], dtype=torch.long)
        torch.distributed.all_reduce(iters, op=torch.distributed.ReduceOp.MAX)
        if int(iters.item()) != iteration:
            print(f"WARNING: on rank {torch.distributed.get_rank()} found iteration {iteration} in {tracker_filename}"
                  f" but the max over ranks is {int(iters.item())}", flush=True)
    return iteration, False


# ----------------------------------------------------------------------------------------------- RNG
def local_rng_state() -> dict[str, Any]:
    """This process's python/numpy/torch/CUDA generator states and the tensor-parallel RNG tracker states."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": get_rng_tracker().get_states(),
    }


def restore_local_rng_state(rng: dict[str, Any]) -> None:
    """Inverse of ``local_rng_state``."""
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    if torch.cuda.is_available() and rng.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(rng["cuda_rng_state"])
    tracker_states = rng.get("rng_tracker_states")
    if tracker_states is None:
        raise CheckpointError("checkpoint has no rng_tracker_states; resume with --no-load-rng")
    get_rng_tracker().set_states(tracker_states)


def get_rng_state(state: Optional[ps.ParallelState] = None) -> list[dict[str, Any]]:
    """This rank's RNG states, gathered over the data-parallel group (one dict per DP rank, as Megatron)."""
    state = state or _state()
    rng = local_rng_state()
    if state.dp_group is not None and state.dp_size > 1:
        gathered: list[Any] = [None] * state.dp_size
        torch.distributed.all_gather_object(gathered, rng, group=state.dp_group)
        return gathered
    return [rng]


def set_rng_state(rng_state_list: list[dict[str, Any]], state: Optional[ps.ParallelState] = None) -> None:
    """Restore the RNG states saved by ``get_rng_state`` (this DP rank's entry, or entry 0 if there is only one)."""
    state = state or _state()
    if isinstance(rng_state_list, dict):  # very old checkpoints stored a single dict
        rng_state_list = [rng_state_list]
    idx = state.dp_rank if len(rng_state_list) > state.dp_rank else 0
    restore_local_rng_state(rng_state_list[idx])


# ----------------------------------------------------------------------------------------------- model helpers
def _as_list(model: Any) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _model_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    module = unwrap_model(module)
    if hasattr(module, "state_dict_for_save_checkpoint"):
        return module.state_dict_for_save_checkpoint()
    return module.state_dict()


def _args_to_save(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of args without values that cannot be pickled (e.g. callables set at run time)."""
    keep = {}
    for key, value in vars(args).items():
        if callable(value) and not isinstance(value, torch.dtype):
            continue
        keep[key] = value
    return argparse.Namespace(**keep)


# ----------------------------------------------------------------------------------------------- save
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
        from megatron.global_vars import get_args

        args = get_args()
    run = train_state if train_state is not None else TrainingState.from_args(args)
    saved_args = _args_to_save(args) if train_state is None else train_state.megatron_args(args)
    cfg = settings if settings is not None else CheckpointSettings.from_args(args)
    return write_checkpoint(iteration, model, optimizer, opt_param_scheduler, cfg, architecture_from_args(args),
                            saved_args, run, save_dir=save_dir, train_loss=train_loss)


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
    model_sds = model_sds or [_model_state_dict(chunk) for chunk in models]
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
    state = _state()
    models = _as_list(model)
    _print0(f"saving checkpoint at iteration {iteration:7d} to {save_dir}")
    iter_dir = os.path.dirname(os.path.dirname(get_checkpoint_name(save_dir, iteration)))
    if _is_rank0():  # before anyone writes: crashed writes' temp files go, a rewritten iteration must not verify
        integrity.prepare_save(save_dir, iter_dir, _print0)
    _barrier()

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
        model_sds = [expert_shards.model_state(_model_state_dict(chunk), models, whole) for chunk in models]
        if param_state is not None:
            param_state = expert_shards.param_state(param_state, whole, models)
        elif optimizer is not None and not cfg.no_save_optim:
            optim_sd = expert_shards.regular_optimizer_state(optimizer.state_dict(), models, whole)
    writer = state.writes_checkpoint
    if writer is None:  # a state built by hand: Megatron-LM's rule
        writer = (state.edp_rank if state.ep_size > 1 else state.dp_rank) == 0
    if writer and state.cp_rank == 0:  # one writer per model-parallel (and expert) rank folder
        # (parallel_state.checkpoint_writer); context-parallel ranks hold the same weights
        state_dict = _rank_state_dict(iteration, models, model_sds, (optimizer, optim_sd, opt_param_scheduler), cfg,
                                      architecture, saved_args, run, train_loss, rng_state)
        _atomic_save(state_dict, checkpoint_name)
        if param_state is not None:
            _atomic_save(param_state, get_distributed_optimizer_checkpoint_name(checkpoint_name))

    _barrier()
    if cfg.ckpt_format == "torch_dist":
        if _is_rank0():  # the per-rank files just written become one torch_dist folder (any layout loads it)
            from megatron.checkpoint.formats import rewrite_as_torch_dist

            rewrite_as_torch_dist(save_dir, iteration, iter_dir,
                                  optimizer=optimizer is not None and not cfg.no_save_optim)
        _barrier()
    if _is_rank0():  # the manifest is written last of the iteration, then the tracker moves
        if sign:
            integrity.write_manifest(iter_dir)
        _atomic_write_text(get_checkpoint_tracker_filename(save_dir), str(iteration))
        if sign:
            integrity.prune_after_save(save_dir, iteration, cfg.keep_last_n_checkpoints, _print0)
    _barrier()
    _print0(f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir}")
    return checkpoint_name


# ----------------------------------------------------------------------------------------------- load
def load_state_dict_file(path: str, trust: bool = False) -> dict[str, Any]:
    """torch.load through megatron.checkpoint.safe_load: weights-only plus the checkpoint allow-list, unless ``trust``
    (--trust-checkpoint / MEGATRON_TRUST_CHECKPOINT=1); anything else is a one-line UnsafeCheckpointError."""
    return safe_torch_load(path, map_location="cpu", trust=trust)


def _find_rank_dirs(iter_dir: str) -> list[str]:
    if not os.path.isdir(iter_dir):
        return []
    return sorted(d for d in os.listdir(iter_dir) if d.startswith("mp_rank_"))


def _saved_sizes(iter_dir: str, rank_dirs: list[str]) -> tuple[int, int, int]:
    """(TP, PP, EP) sizes a checkpoint was saved with, from its ``mp_rank_*`` folders; a three-part name
    (``mp_rank_00_001``) is a pipeline or an expert rank, told apart by the saved args of its first rank's file."""
    parts = [d.split("_")[2:] for d in rank_dirs]
    sizes = [len({p[i] for p in parts if len(p) > i}) or 1 for i in range(3)]
    if max(len(p) for p in parts) >= 3:  # mp_rank_TT_PPP_EEE
        return sizes[0], sizes[1], sizes[2]
    if max(len(p) for p in parts) < 2:
        return sizes[0], 1, 1
    try:
        saved = safe_torch_load(model_file_name(os.path.join(iter_dir, rank_dirs[0], "model_optim_rng.pt")),
                                mmap=True).get("args")
    except (MegatronUserError, OSError, RuntimeError, AttributeError):
        saved = None
    if (getattr(saved, "expert_model_parallel_size", 1) or 1) > 1 and \
            (getattr(saved, "pipeline_model_parallel_size", 1) or 1) == 1:
        return sizes[0], 1, sizes[1]
    return sizes[0], sizes[1], 1


def _check_layout(load_dir: str, iteration: int, release: bool, checkpoint_name: str) -> None:
    """Explain a missing rank file: usually a different TP/PP/EP layout than this run's."""
    iter_dir = os.path.dirname(os.path.dirname(checkpoint_name))
    rank_dirs = _find_rank_dirs(iter_dir)
    if not rank_dirs:
        raise CheckpointError(
            f"checkpoint {iter_dir} (named by {get_checkpoint_tracker_filename(load_dir)}) does not exist; "
            "fix the tracker file or --load"
        )
    tp, pp, ep = _saved_sizes(iter_dir, rank_dirs)
    state = _state()
    saved = [("tensor-model-parallel-size", tp, state.tp_size), ("pipeline-model-parallel-size", pp, state.pp_size)]
    if ep > 1 or state.ep_size > 1:
        saved.append(("expert-model-parallel-size", ep, state.ep_size))
    raise CheckpointError(
        f"checkpoint {iter_dir} was saved with " + " and ".join(f"--{f} {s}" for f, s, _ in saved) +
        ", but this run uses " + " and ".join(str(c) for _, _, c in saved) +
        f" (no {os.path.relpath(checkpoint_name, load_dir)}); use the same sizes, or {reshard_hint(load_dir)}"
    )


def check_checkpoint_args(checkpoint_args: argparse.Namespace, args: argparse.Namespace, path: str,
                          architecture: Optional[dict] = None, settings: Optional[CheckpointSettings] = None) -> None:
    """One-line error when the checkpoint's parallel layout or architecture (stored ``architecture``, else computed
    from its saved args) differs from this run (``args``; its parallel sizes from `settings` when given)."""
    cfg = settings if settings is not None else CheckpointSettings.from_args(args)
    check_checkpoint_layout(checkpoint_args, cfg, architecture_from_args(args), path, architecture)


def check_checkpoint_layout(checkpoint_args: Optional[argparse.Namespace], cfg: CheckpointSettings,
                            current: Mapping[str, Any], path: str, architecture: Optional[dict] = None) -> None:
    """`check_checkpoint_args` on records: this run's parallel sizes (`cfg`) and architecture (`current`)."""
    for flag, attr in _PARALLEL_ARGS:
        saved = getattr(checkpoint_args, attr, None)
        current_size = cfg.parallel_size(attr)
        if saved is None or current_size is None or saved == current_size:
            continue
        raise CheckpointError(
            f"checkpoint {path} has {attr}={saved} but this run has {attr}={current_size}: "
            f"set {flag} {saved} or {reshard_hint(path)}, or start without --load"
        )
    compare_architecture(saved_architecture(architecture, checkpoint_args), current, path)


def load_args_from_checkpoint(args: argparse.Namespace, load_arg: str = "load") -> argparse.Namespace:
    """--use-checkpoint-args: restore the whole architecture saved in the checkpoint that load_checkpoint will load
    (the tracker's iteration, or the newest intact one below it) into ``args``."""
    cfg = CheckpointSettings.from_args(args, load_arg)
    load_dir = cfg.load
    if not load_dir:
        raise CheckpointError("--use-checkpoint-args needs --load DIR")
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        def select_tag(latest_tag: str) -> str:  # the tag megatron/ds/engine.py will load
            try:
                return integrity.select_deepspeed_tag(load_dir, latest_tag,
                                                      not cfg.no_checkpoint_fallback, first_failure_reason, _print0)
            except ValueError as exc:
                raise CheckpointError(f"--use-checkpoint-args: {exc}") from None

        # a DeepSpeed checkpoint keeps Megatron's state in its client state
        name = deepspeed_state_file(load_dir, select_tag)
        if name is None:
            raise CheckpointError(f"--use-checkpoint-args: no {TRACKER_FILENAME} (or DeepSpeed 'latest') in {load_dir}")
        use_checkpoint_args(args, load_state_dict_file(name, trust=cfg.trust_checkpoint))
        return args
    iteration, release = read_metadata(tracker)
    iter_dir = _iteration_dir(load_dir, iteration, release)
    trust = cfg.trust_checkpoint
    if os.path.isdir(iter_dir) and is_dist_folder(iter_dir):  # Megatron-LM's args live in common.pt
        selected = _verified_foreign_folder(cfg, iteration, release, check_flags=False)  # the one --load loads
        use_checkpoint_args(args, read_common(selected[1] if selected else iter_dir, trust))
        return args

    def rank0_file(cand: int) -> str:  # the layout is not known yet: TP rank 0 / PP stage 0 / EP rank 0, any naming
        names = [get_checkpoint_name(load_dir, cand, release, pipeline_parallel=pp, tensor_rank=0, pipeline_rank=0,
                                     expert_parallel=ep, expert_rank=0)
                 for pp, ep in ((False, False), (True, False), (True, True))]
        return next((n for n in names if os.path.isdir(os.path.dirname(n))), names[0])

    # The iteration load_checkpoint will load: the tracker's, or the newest intact one below it (integrity fallback).
    _, name, sd = _select_checkpoint(load_dir, iteration, release, trust, not cfg.no_checkpoint_fallback, rank0_file)
    if sd.get("args") is None and not sd.get("architecture"):
        raise CheckpointError(f"--use-checkpoint-args: {name} holds no args")
    use_checkpoint_args(args, sd)
    return args


def _load_optimizer(optimizer: Any, optim_sd: dict, models: list, checkpoint_name: str, trust: bool = False,
                    experts_whole: bool = False) -> None:
    """Load the optimizer state; converts between the distributed optimizer's layout (``distrib_optim.pt``) and the
    regular one in either direction (the saved state is complete per parameter). `experts_whole`: the checkpoint
    holds the experts whole and this rank takes its expert-TP slice (megatron/checkpoint/expert_shards.py)."""
    from megatron.optimizer.distrib_optimizer import param_state_to_regular_state, regular_state_to_param_state

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
            param_state = expert_shards.param_state(param_state, expert_shards.take_slice(_state()), models)
    elif experts_whole:
        optim_sd = expert_shards.regular_optimizer_state(optim_sd, models, expert_shards.take_slice(_state()))
    try:
        if is_distributed:
            optimizer.load_state_dict(optim_sd)
            if param_state is None:
                _print0(" converting the regular optimizer state of the checkpoint for --use-distributed-optimizer")
                param_state = regular_state_to_param_state(optim_sd, models)
            optimizer.load_parameter_state(param_state)
        elif saved_distributed:
            _print0(" converting the checkpoint's --use-distributed-optimizer state for the regular optimizer")
            optimizer.load_state_dict(param_state_to_regular_state(param_state, optim_sd, models, optimizer))
        else:
            optimizer.load_state_dict(optim_sd)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot load the optimizer state of {checkpoint_name}: {exc}") from None


def first_failure_reason(reason: Optional[str]) -> Optional[str]:
    """The first rank's failure reason (None when every rank's files verified and loaded); collective."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        reasons: list[Optional[str]] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(reasons, reason)
        return next((r for r in reasons if r is not None), None)
    return reason


def _select_checkpoint(load_dir: str, iteration: int, release: bool, trust: bool, fallback: bool,
                       checkpoint_name: Optional[Callable[[int], str]] = None) -> tuple[int, str, dict[str, Any]]:
    """(iteration, this rank's file, its state dict) of the newest iteration at or below the tracker's whose files
    match their manifest and unpickle on every rank. Skipped iterations are named in one line; with
    ``fallback=False`` (--no-checkpoint-fallback) the first failure is a one-line CheckpointError.
    `checkpoint_name(iteration)` overrides which file is read (default: this rank's).

    Iterations newer than the tracker's are never loaded: the tracker is the commit point, so they are incomplete
    by definition (e.g. a crash after the files but before the tracker update); one line names them."""
    if not release:
        newer = sorted(it for it in integrity.iterations(load_dir) if it > iteration)
        if newer:
            _print0(f"note: iteration(s) {', '.join(map(str, newer))} in {load_dir} are newer than the tracker's "
                    f"{iteration} ({TRACKER_FILENAME}); not loaded: the tracker marks the last committed checkpoint")
    candidates = [iteration] + ([] if release else [it for it in integrity.iterations(load_dir) if it < iteration])
    skipped: list[str] = []
    for cand in candidates:
        name = model_file_name(checkpoint_name(cand) if checkpoint_name is not None
                               else get_checkpoint_name(load_dir, cand, release))
        iter_dir = os.path.dirname(os.path.dirname(name))
        rel = os.path.relpath(name, iter_dir)
        reason: Optional[str] = None
        sd: dict[str, Any] = {}
        unverified = False
        if not os.path.isdir(iter_dir):
            reason = f"{os.path.basename(iter_dir)} does not exist"
        elif not os.path.isdir(os.path.dirname(name)) and cand == iteration and _find_rank_dirs(iter_dir):
            _check_layout(load_dir, cand, release, name)  # another TP/PP layout: an error, not damage
        else:
            reason = integrity.verify(iter_dir, [rel, os.path.join(os.path.dirname(rel), "distrib_optim.pt")])
            unverified = reason == integrity.NO_MANIFEST
            if unverified:
                reason = None
            if reason is None:
                try:
                    sd = load_state_dict_file(name, trust)
                except CheckpointFileError as exc:
                    reason = str(exc)
        reason = first_failure_reason(reason)
        if reason is None:
            if unverified:
                _print0(f"note: {iter_dir} has no {integrity.MANIFEST_NAME} (saved before integrity checks); "
                        "loaded without verifying it")
            if skipped:
                _print0(f"WARNING: skipped damaged checkpoint iteration(s) {'; '.join(skipped)} in {load_dir}; "
                        f"loading iteration {cand}")
            return cand, name, sd
        if not fallback:
            raise CheckpointError(f"checkpoint iteration {cand} in {load_dir} is damaged: {reason}; restore it, or "
                                  "drop --no-checkpoint-fallback to load the newest intact iteration")
        skipped.append(f"{cand} ({reason})")
    raise CheckpointError(f"no intact checkpoint in --load {load_dir}: {'; '.join(skipped)}; restore one, or start "
                          "without --load")


def _iteration_dir(load_dir: str, iteration: int, release: bool) -> str:
    return os.path.join(load_dir, "release" if release else f"iter_{iteration:07d}")


def _load_other_format(models: list, cfg: CheckpointSettings, architecture: Mapping[str, Any], iteration: int,
                       release: bool, state: ps.ParallelState, run: TrainingState, optimizer: Any = None,
                       opt_param_scheduler: Any = None,
                       on_restored: Optional[Callable[[TrainingState, tuple], None]] = None) -> Optional[int]:
    """Megatron Core layouts (per-rank files with Core names, torch_dist): load their weights (and a torch_dist
    folder's training state) at this run's layout (megatron/checkpoint/formats.py) and return the iteration; None for
    our own layout. The folder is verified first (`_verified_foreign_folder`) and recorded for `last_loaded`."""
    selected = _verified_foreign_folder(cfg, iteration, release)
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
    _barrier()
    _print0(f"  successfully loaded checkpoint from {cfg.load} at iteration {iteration}")
    return iteration


def _verified_foreign_folder(cfg: CheckpointSettings, iteration: int, release: bool, check_flags: bool = True
                             ) -> Optional[tuple[str, str, bool]]:
    """(format, iteration folder, verified) to load for the tracker's `iteration`: a torch_dist folder (any folder
    holding Megatron-LM's metadata.json) is the newest one at or below it whose files all match its manifest (every
    rank reads it whole; skipped ones named in one line, --no-checkpoint-fallback: an error), then its metadata.json
    must be readable; a Megatron Core per-rank folder must verify as it is. A folder without a manifest loads with a
    note, `verified` False. None (or format TORCH) for our own layout: `_select_checkpoint` verifies that.
    `check_flags`: the folder's format must agree with --ckpt-format (`check_format_flags`)."""
    load_dir = cfg.load
    iter_dir = _iteration_dir(load_dir, iteration, release)
    if not os.path.isdir(iter_dir):
        return None
    if not is_dist_folder(iter_dir):
        fmt = detect_format(iter_dir, cfg.trust_checkpoint)
        if check_flags:
            check_format_flags(fmt, cfg, iter_dir)
        if fmt == TORCH:
            return None
        reason = integrity.verify(iter_dir)
        if reason is not None and reason != integrity.NO_MANIFEST:
            raise CheckpointFormatError(f"checkpoint {iter_dir} is damaged: {reason}; restore it")
        if reason is not None:
            _print0(f"note: {iter_dir} has no {integrity.MANIFEST_NAME} (saved before integrity checks); loaded "
                    "without verifying it")
        return fmt, iter_dir, reason is None
    if check_flags:
        check_format_flags(TORCH_DIST, cfg, iter_dir)
    if release:  # nothing to fall back to
        reason = integrity.verify(iter_dir)
        verified = reason is None
        reason = first_failure_reason(None if reason == integrity.NO_MANIFEST else reason)
        if reason is not None:
            raise CheckpointError(f"checkpoint {iter_dir} is damaged: {reason}; restore it")
        if not verified:
            _print0(f"note: {iter_dir} has no {integrity.MANIFEST_NAME} (saved before integrity checks); loaded "
                    "without verifying it")
    else:
        try:
            chosen, verified = integrity.select_whole_folder(load_dir, iteration, not cfg.no_checkpoint_fallback,
                                                             first_failure_reason, _print0, is_dist_folder)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        iter_dir = _iteration_dir(load_dir, chosen, False)
    try:
        check_torch_dist(iter_dir)
    except ConversionError as exc:
        raise CheckpointFormatError(str(exc)) from None
    return TORCH_DIST, iter_dir, verified


@dataclasses.dataclass
class LoadedCheckpoint:
    """What the last load_checkpoint of this process read (training's divergence checks use it)."""

    folder: str  # the iteration folder
    iteration: int
    verified: bool  # False: it had no manifest.json and was loaded unverified
    train_loss: Optional[float]  # the loss recorded when it was saved (None for older checkpoints)


_LAST_LOADED: Optional[LoadedCheckpoint] = None


def last_loaded() -> Optional[LoadedCheckpoint]:
    return _LAST_LOADED


def forget_last_loaded() -> None:
    global _LAST_LOADED
    _LAST_LOADED = None


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
        from megatron.global_vars import get_args

        args = get_args()
    cfg = settings if settings is not None else CheckpointSettings.from_args(args, load_arg)
    run = train_state if train_state is not None else TrainingState()
    on_restored = None if train_state is not None else \
        (lambda restored, names: restored.write_counters(args, names))
    return read_checkpoint(model, optimizer, opt_param_scheduler, cfg, architecture_from_args(args), run,
                           strict=strict, on_restored=on_restored)


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
    state = _state()
    models = _as_list(model)
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        if cfg.exit_on_missing_checkpoint:
            raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint ({tracker}) in --load {load_dir}")
        _print0(f" no checkpoint in {load_dir} yet ({os.path.basename(tracker)} not found): will not load any "
                "checkpoints and will start from random")
        return 0
    iteration, release = read_metadata(tracker)
    trust = cfg.trust_checkpoint
    foreign = _load_other_format(models, cfg, architecture, iteration, release, state, run, optimizer,
                                 opt_param_scheduler, on_restored)
    if foreign is not None:
        return foreign
    iteration, checkpoint_name, sd = _select_checkpoint(load_dir, iteration, release, trust,
                                                        not cfg.no_checkpoint_fallback)
    _print0(f" loading checkpoint from {load_dir} at iteration {iteration}")
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

    _barrier()
    restart = "" if iteration == loaded_iteration else \
        f"; training starts at iteration {iteration} ({'--finetune' if finetune else 'a release checkpoint'})"
    _print0(f"  successfully loaded checkpoint from {load_dir} at iteration {loaded_iteration}{restart}")
    sys.stdout.flush()
    return iteration
