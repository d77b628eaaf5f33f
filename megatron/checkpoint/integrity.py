"""Checkpoint integrity: a manifest per iteration, verification on load, and pruning of old iterations.

After every file of an iteration is written (and before the tracker moves), global rank 0 writes
``<iteration dir>/manifest.json`` — atomically, last — listing each file's size and CRC-32 (zlib, ~1 GB/s). Loading
verifies the files a rank is about to read against it; `load_checkpoint` walks the iterations from the tracker's down
and takes the newest that verifies (``--no-checkpoint-fallback``: the first failure is an error instead). Iterations
written before manifests existed load as before (with a note). Works for our ``iter_XXXXXXX`` folders and DeepSpeed's
``global_stepN`` ones.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from typing import Callable, Iterable, Optional

from megatron.checkpoint.atomic_io import atomic_write_text, fault_point, is_temp_file, remove_stale_temp_files

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
NO_MANIFEST = "no manifest (written before integrity checks); not verified"
_ITER_RE = {"megatron": re.compile(r"^iter_(\d{7})$"), "deepspeed": re.compile(r"^global_step(\d+)$")}
_CHUNK = 8 << 20


def read_pointer_file(path: str) -> str:
    """The stripped text of a tracker file (``latest_checkpointed_iteration.txt``, DeepSpeed's ``latest``); a
    ValueError with one line when its bytes are not text (e.g. a disk error wrote garbage)."""
    with open(path, "rb") as f:
        data = f.read(4096)
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not text (byte 0x{data[exc.start]:02x} at offset {exc.start} is not UTF-8); it "
                         "must hold an iteration number or 'release' (a DeepSpeed tag for 'latest'): fix or delete "
                         "the file") from None


def file_crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            crc = zlib.crc32(block, crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def _listing(iter_dir: str) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(iter_dir):
        for name in filenames:
            if name == MANIFEST_NAME or is_temp_file(name):
                continue
            out.append(os.path.relpath(os.path.join(dirpath, name), iter_dir))
    return sorted(out)


def remove_manifest(iter_dir: str) -> None:
    """Before (re)writing an iteration: until the new manifest exists it must not verify."""
    path = os.path.join(iter_dir, MANIFEST_NAME)
    if os.path.exists(path):
        os.remove(path)


def write_manifest(iter_dir: str) -> dict:
    """Record size and CRC-32 of every file under `iter_dir` (rank 0, after all ranks wrote; atomic, written last)."""
    files = {rel: {"size": os.path.getsize(os.path.join(iter_dir, rel)),
                   "crc32": file_crc32(os.path.join(iter_dir, rel))} for rel in _listing(iter_dir)}
    manifest = {"version": MANIFEST_VERSION, "files": files}
    atomic_write_text(os.path.join(iter_dir, MANIFEST_NAME), json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def read_manifest(iter_dir: str) -> Optional[dict]:
    """The manifest, None when there is none; raises ValueError when it is unreadable."""
    path = os.path.join(iter_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' table")
        return manifest
    except (OSError, ValueError) as exc:
        raise ValueError(f"{MANIFEST_NAME} is unreadable ({exc})") from None


def verify(iter_dir: str, only: Optional[Iterable[str]] = None) -> Optional[str]:
    """None when the files (all, or the relative paths in `only` that the manifest lists) match the manifest;
    otherwise a short reason. `NO_MANIFEST` for iterations written before manifests existed."""
    if not os.path.isdir(iter_dir):
        return f"{iter_dir} does not exist"
    try:
        manifest = read_manifest(iter_dir)
    except ValueError as exc:
        return str(exc)
    if manifest is None:
        return NO_MANIFEST
    files = manifest["files"]
    names = sorted(files) if only is None else [rel for rel in only if rel in files]
    for rel in names:
        path = os.path.join(iter_dir, rel)
        expected = files[rel]
        if not os.path.isfile(path):
            return f"{rel} is missing"
        size = os.path.getsize(path)
        if size != expected.get("size"):
            return f"{rel} has {size} bytes, the manifest recorded {expected.get('size')} (truncated or rewritten)"
        crc = file_crc32(path)
        if crc != expected.get("crc32"):
            return f"{rel} has checksum {crc}, the manifest recorded {expected.get('crc32')} (corrupted)"
    return None


def listed(iter_dir: str, rel: str) -> Optional[bool]:
    """Whether the manifest lists `rel` (None without a readable manifest)."""
    try:
        manifest = read_manifest(iter_dir)
    except ValueError:
        return None
    return None if manifest is None else rel in manifest["files"]


def iterations(root: str, layout: str = "megatron") -> list[int]:
    """Iteration numbers of the iteration folders under `root`, newest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _ITER_RE[layout].match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append(int(m.group(1)))
    return sorted(found, reverse=True)


def iteration_dir(root: str, iteration: int, layout: str = "megatron") -> str:
    return os.path.join(root, f"iter_{iteration:07d}" if layout == "megatron" else f"global_step{iteration}")


def prune(root: str, keep: int, newest: int, layout: str = "megatron") -> list[int]:
    """--keep-last-n-checkpoints: once iteration `newest` verifies completely, delete all but the `keep` newest
    iterations (never `newest` itself, never anything newer). Returns the deleted iterations."""
    if keep <= 0 or verify(iteration_dir(root, newest, layout)) is not None:
        return []
    older = [it for it in iterations(root, layout) if it < newest]
    deleted = []
    for it in older[max(0, keep - 1):]:
        fault_point(f"prune:{it}")
        shutil.rmtree(iteration_dir(root, it, layout), ignore_errors=True)
        deleted.append(it)
    return deleted


def prepare_save(save_dir: str, iter_dir: str, log: Callable[[str], None] = print) -> None:
    """Rank 0, before any rank writes an iteration: remove temp files of crashed writes (one line saying how many)
    and the iteration's old manifest (a rewrite must not verify until it is complete)."""
    removed = remove_stale_temp_files(save_dir)
    if removed:
        log(f" removed {len(removed)} temporary file(s) of interrupted checkpoint writes in {save_dir} "
            f"(e.g. {os.path.relpath(removed[0], save_dir)})")
    remove_manifest(iter_dir)


def prune_after_save(save_dir: str, iteration: int, keep: Optional[int], log: Callable[[str], None] = print,
                     layout: str = "megatron") -> None:
    """Rank 0, after the manifest and the tracker: --keep-last-n-checkpoints N."""
    if not keep:
        return
    deleted = prune(save_dir, keep, iteration, layout)
    if deleted:
        log(f" --keep-last-n-checkpoints {keep}: deleted iteration(s) {', '.join(map(str, sorted(deleted)))} "
            f"after iteration {iteration} verified")
    elif iterations(save_dir, layout)[keep:] and verify(iteration_dir(save_dir, iteration, layout)) is not None:
        log(f"WARNING: iteration {iteration} does not verify: kept the older checkpoints")


def select_deepspeed_tag(load_dir: str, latest_tag: str, fallback: bool, agree: Callable[[Optional[str]], Optional[str]],
                         log: Callable[[str], None] = print) -> str:
    """The newest ``global_stepN`` at or below `latest_tag` whose files match their manifest (every rank reads
    them all: DeepSpeed's loader opens model and ZeRO files of other ranks too). `agree` makes the reason collective.
    Raises ValueError with a one-line reason when none verifies (or the latest does not and not `fallback`)."""
    m = _ITER_RE["deepspeed"].match(latest_tag)
    if not m:
        return latest_tag  # a custom tag: nothing to fall back to
    newest = int(m.group(1))
    newer = sorted(it for it in iterations(load_dir, "deepspeed") if it > newest)
    if newer:  # 'latest' is the commit point: anything after it is incomplete by definition
        log(f"note: global_step(s) {', '.join(map(str, newer))} in {load_dir} are newer than 'latest' ({latest_tag}); "
            "not loaded: 'latest' marks the last committed checkpoint")
    candidates = [newest] + [it for it in iterations(load_dir, "deepspeed") if it < newest]
    cand, _ = _first_intact(load_dir, candidates, "deepspeed", fallback, agree, log)
    return f"global_step{cand}"


def select_whole_folder(load_dir: str, newest: int, fallback: bool, agree: Callable[[Optional[str]], Optional[str]],
                        log: Callable[[str], None] = print, eligible: Callable[[str], bool] = os.path.isdir
                        ) -> tuple[int, bool]:
    """(iteration, verified) of the newest ``iter_XXXXXXX`` at or below `newest` (the tracker's) whose files all
    match its manifest, for a format every rank reads whole (torch_dist); older folders count only when `eligible`.
    `verified` is False for a folder without a manifest (loaded with a note). Iterations newer than the tracker are
    named in one note and never loaded (the tracker is the commit point). Raises ValueError with one line when none
    verifies (or the newest does not and not `fallback`)."""
    newer = sorted(it for it in iterations(load_dir) if it > newest)
    if newer:
        log(f"note: iteration(s) {', '.join(map(str, newer))} in {load_dir} are newer than the tracker's {newest} "
            "(latest_checkpointed_iteration.txt); not loaded: the tracker marks the last committed checkpoint")
    older = [it for it in iterations(load_dir) if it < newest and eligible(iteration_dir(load_dir, it))]
    return _first_intact(load_dir, [newest] + older, "megatron", fallback, agree, log)


def _first_intact(load_dir: str, candidates: list[int], layout: str, fallback: bool,
                  agree: Callable[[Optional[str]], Optional[str]], log: Callable[[str], None]) -> tuple[int, bool]:
    """(the first of `candidates` whose whole folder verifies on every rank, verified); ValueError as above."""
    label = (lambda it: f"global_step{it}") if layout == "deepspeed" else (lambda it: f"iteration {it}")
    skipped: list[str] = []
    for cand in candidates:
        folder = iteration_dir(load_dir, cand, layout)
        reason = verify(folder)
        unverified = reason == NO_MANIFEST
        reason = agree(None if unverified else reason)
        if reason is None:
            if unverified:
                log(f"note: {folder} has no {MANIFEST_NAME} (saved before integrity checks); "
                    "loaded without verifying it")
            if skipped:
                what = "checkpoint(s)" if layout == "deepspeed" else "checkpoint iteration(s)"
                log(f"WARNING: skipped damaged {what} {'; '.join(skipped)} in {load_dir}; loading {label(cand)}")
            return cand, not unverified
        if not fallback:
            raise ValueError(f"checkpoint {label(cand)} in {load_dir} is damaged: {reason}; restore it, or drop "
                             "--no-checkpoint-fallback to load the newest intact one")
        skipped.append(f"{label(cand) if layout == 'deepspeed' else cand} ({reason})")
    raise ValueError(f"no intact checkpoint in --load {load_dir}: {'; '.join(skipped)}; restore one, or start "
                     "without --load")
