"""Which checkpoint a load reads, and whether it fits this run: the newest intact iteration at or below the tracker's
(integrity fallback), the folder of another layout (Megatron Core per-rank files, torch_dist), the parallel layout
and architecture checks, and the file --use-checkpoint-args restores the architecture from.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Mapping, Optional

from megatron.checkpoint import integrity
from megatron.checkpoint.args import (
    checkpoint_flag_values,
    compare_architecture,
    deepspeed_state_file,
    saved_architecture,
)
from megatron.checkpoint.conversion.interchange import ConversionError
from megatron.checkpoint.conversion.torch_dist import check_torch_dist, is_dist_folder, read_common
from megatron.checkpoint.formats import TORCH, TORCH_DIST, CheckpointFormatError, check_format_flags, detect_format
from megatron.checkpoint.paths import (
    TRACKER_FILENAME,
    CheckpointError,
    find_rank_dirs,
    first_failure_reason,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    iteration_dir,
    load_state_dict_file,
    model_file_name,
    print0,
    read_metadata,
    reshard_hint,
)
from megatron.checkpoint.safe_load import CheckpointFileError, safe_torch_load
from megatron.core import parallel_state as ps
from megatron.errors import MegatronUserError
from megatron.run_configs.checkpoint import PARALLEL_SIZE_FLAGS, CheckpointSettings


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
    rank_dirs = find_rank_dirs(iter_dir)
    if not rank_dirs:
        raise CheckpointError(
            f"checkpoint {iter_dir} (named by {get_checkpoint_tracker_filename(load_dir)}) does not exist; "
            "fix the tracker file or --load"
        )
    tp, pp, ep = _saved_sizes(iter_dir, rank_dirs)
    state = ps.current_parallel_state()
    saved = [("tensor-model-parallel-size", tp, state.tp_size), ("pipeline-model-parallel-size", pp, state.pp_size)]
    if ep > 1 or state.ep_size > 1:
        saved.append(("expert-model-parallel-size", ep, state.ep_size))
    raise CheckpointError(
        f"checkpoint {iter_dir} was saved with " + " and ".join(f"--{f} {s}" for f, s, _ in saved) +
        ", but this run uses " + " and ".join(str(c) for _, _, c in saved) +
        f" (no {os.path.relpath(checkpoint_name, load_dir)}); use the same sizes, or {reshard_hint(load_dir)}"
    )


def check_checkpoint_layout(checkpoint_args: Optional[argparse.Namespace], cfg: CheckpointSettings,
                            current: Mapping[str, Any], path: str, architecture: Optional[dict] = None) -> None:
    """`check_checkpoint_args` on records: this run's parallel sizes (`cfg`) and architecture (`current`)."""
    for flag, attr in PARALLEL_SIZE_FLAGS:
        saved = getattr(checkpoint_args, attr, None)
        current_size = cfg.parallel_size(attr)
        if saved is None or current_size is None or saved == current_size:
            continue
        raise CheckpointError(
            f"checkpoint {path} has {attr}={saved} but this run has {attr}={current_size}: "
            f"set {flag} {saved} or {reshard_hint(path)}, or start without --load"
        )
    compare_architecture(saved_architecture(architecture, checkpoint_args), current, path)


def restored_flag_values(cfg: CheckpointSettings, given: Mapping[str, Any]) -> dict[str, Any]:
    """--use-checkpoint-args: {flag destination: value} restoring the whole architecture saved in the checkpoint that
    the load will read (the tracker's iteration, or the newest intact one below it), for flags whose values as parsed
    are `given` (a flag given explicitly with another value is a one-line error)."""
    return checkpoint_flag_values(checkpoint_args_source(cfg), given)


def checkpoint_args_source(cfg: CheckpointSettings) -> Mapping[str, Any]:
    """The state dict --use-checkpoint-args takes the architecture from (its ``args`` and ``architecture``): rank 0's
    file of the iteration the load will read, a torch_dist folder's common state or a DeepSpeed checkpoint's client
    state."""
    load_dir = cfg.load
    if not load_dir:
        raise CheckpointError("--use-checkpoint-args needs --load DIR")
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        def select_tag(latest_tag: str) -> str:  # the tag megatron/ds/engine.py will load
            try:
                return integrity.select_deepspeed_tag(load_dir, latest_tag,
                                                      not cfg.no_checkpoint_fallback, first_failure_reason, print0)
            except ValueError as exc:
                raise CheckpointError(f"--use-checkpoint-args: {exc}") from None

        # a DeepSpeed checkpoint keeps Megatron's state in its client state
        name = deepspeed_state_file(load_dir, select_tag)
        if name is None:
            raise CheckpointError(f"--use-checkpoint-args: no {TRACKER_FILENAME} (or DeepSpeed 'latest') in {load_dir}")
        return load_state_dict_file(name, trust=cfg.trust_checkpoint)
    iteration, release = read_metadata(tracker)
    iter_dir = iteration_dir(load_dir, iteration, release)
    trust = cfg.trust_checkpoint
    if os.path.isdir(iter_dir) and is_dist_folder(iter_dir):  # Megatron-LM's args live in common.pt
        selected = verified_foreign_folder(cfg, iteration, release, check_flags=False)  # the one --load loads
        return read_common(selected[1] if selected else iter_dir, trust)

    def rank0_file(cand: int) -> str:  # the layout is not known yet: TP rank 0 / PP stage 0 / EP rank 0, any naming
        names = [get_checkpoint_name(load_dir, cand, release, pipeline_parallel=pp, tensor_rank=0, pipeline_rank=0,
                                     expert_parallel=ep, expert_rank=0)
                 for pp, ep in ((False, False), (True, False), (True, True))]
        return next((n for n in names if os.path.isdir(os.path.dirname(n))), names[0])

    # The iteration load_checkpoint will load: the tracker's, or the newest intact one below it (integrity fallback).
    _, name, sd = select_checkpoint(load_dir, iteration, release, trust, not cfg.no_checkpoint_fallback, rank0_file)
    if sd.get("args") is None and not sd.get("architecture"):
        raise CheckpointError(f"--use-checkpoint-args: {name} holds no args")
    return sd


def select_checkpoint(load_dir: str, iteration: int, release: bool, trust: bool, fallback: bool,
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
            print0(f"note: iteration(s) {', '.join(map(str, newer))} in {load_dir} are newer than the tracker's "
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
        elif not os.path.isdir(os.path.dirname(name)) and cand == iteration and find_rank_dirs(iter_dir):
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
                print0(f"note: {iter_dir} has no {integrity.MANIFEST_NAME} (saved before integrity checks); "
                        "loaded without verifying it")
            if skipped:
                print0(f"WARNING: skipped damaged checkpoint iteration(s) {'; '.join(skipped)} in {load_dir}; "
                        f"loading iteration {cand}")
            return cand, name, sd
        if not fallback:
            raise CheckpointError(f"checkpoint iteration {cand} in {load_dir} is damaged: {reason}; restore it, or "
                                  "drop --no-checkpoint-fallback to load the newest intact iteration")
        skipped.append(f"{cand} ({reason})")
    raise CheckpointError(f"no intact checkpoint in --load {load_dir}: {'; '.join(skipped)}; restore one, or start "
                          "without --load")


def verified_foreign_folder(cfg: CheckpointSettings, iteration: int, release: bool, check_flags: bool = True
                             ) -> Optional[tuple[str, str, bool]]:
    """(format, iteration folder, verified) to load for the tracker's `iteration`: a torch_dist folder (any folder
    holding Megatron-LM's metadata.json) is the newest one at or below it whose files all match its manifest (every
    rank reads it whole; skipped ones named in one line, --no-checkpoint-fallback: an error), then its metadata.json
    must be readable; a Megatron Core per-rank folder must verify as it is. A folder without a manifest loads with a
    note, `verified` False. None (or format TORCH) for our own layout: `select_checkpoint` verifies that.
    `check_flags`: the folder's format must agree with --ckpt-format (`check_format_flags`)."""
    load_dir = cfg.load
    iter_dir = iteration_dir(load_dir, iteration, release)
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
            print0(f"note: {iter_dir} has no {integrity.MANIFEST_NAME} (saved before integrity checks); loaded "
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
            print0(f"note: {iter_dir} has no {integrity.MANIFEST_NAME} (saved before integrity checks); loaded "
                    "without verifying it")
    else:
        try:
            chosen, verified = integrity.select_whole_folder(load_dir, iteration, not cfg.no_checkpoint_fallback,
                                                             first_failure_reason, print0, is_dist_folder)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        iter_dir = iteration_dir(load_dir, chosen, False)
    try:
        check_torch_dist(iter_dir)
    except ConversionError as exc:
        raise CheckpointFormatError(str(exc)) from None
    return TORCH_DIST, iter_dir, verified
