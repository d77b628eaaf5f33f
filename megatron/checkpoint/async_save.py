"""--async-save (Megatron-LM's flag): a checkpoint's files are written in the background while training continues, and
the checkpoint is published (manifest.json, then latest_checkpointed_iteration.txt) only once every rank's files are
complete.

The save itself (megatron/checkpoint/saving.py) builds each rank's state as a synchronous save does; `schedule` copies
its containers at once (the tensors stay the live ones: a pickle round trip, cheap) and hands them to a background
job, which first copies the tensors (every storage cloned once, views kept as views, so ``torch.save`` writes the
same bytes) and then writes the copy. The loop is not blocked by the copy: it runs during the next forward and
backward passes, and what changes saved state (the expert-bias update, the optimizer step) first waits for what is
left of it (megatron/core/saved_state.py). `maybe_finalize` (Megatron's ``maybe_finalize_async_save``) is
collective: the training loop calls it after every iteration (non-blocking: one small all-reduce while a save is in
flight), the next save and the end of training call it blocking. Once every rank's files are on disk, rank 0
publishes in the background: the ``torch_dist`` rewrite, the manifest, the tracker, --keep-last-n-checkpoints. A
process killed before that leaves the tracker on the previous checkpoint, which is then the one loaded (the
unfinished iteration's temporary files are removed by the next save).

Why threads and not a process (Megatron forks one, or keeps a persistent one, because its state must leave the GPU
and its writers hold the GIL): here the state is already in host memory, the tensor copies, ``torch.save``'s file
writer and ``fsync`` release the GIL, and a thread reads the state where it lies, while a process would need the
state copied into shared memory or pickled through a pipe, which costs what the write costs. With
--use-persistent-ckpt-worker one long-lived writer thread serves every save (Megatron's persistent worker); without
it each save starts its own.
"""
from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import io
import pickle
import threading
from typing import Any, Callable, Optional

import torch

from megatron.checkpoint.paths import CheckpointError, print0
from megatron.core import saved_state


class AsyncSaveError(CheckpointError):
    """An asynchronous checkpoint write failed on some rank; the previous checkpoint stays the latest."""


@dataclasses.dataclass
class _Save:
    """A save in flight on this rank: its iteration, this rank's writes, rank 0's publication (None elsewhere), the
    kind of writer (--use-persistent-ckpt-worker)."""

    iteration: int
    write: concurrent.futures.Future
    publish: Optional[Callable[[], None]]
    persistent: bool


class _Writers:
    """The background writer(s): one persistent thread, or one thread per job."""

    def __init__(self) -> None:
        self.persistent: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def submit(self, job: Callable[[], None], persistent: bool) -> concurrent.futures.Future:
        if persistent:
            if self.persistent is None:
                self.persistent = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megatron-ckpt-worker")
            return self.persistent.submit(job)
        executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megatron-ckpt-writer")
        future = executor.submit(job)
        executor.shutdown(wait=False)  # the thread ends with its job
        return future


_WRITERS = _Writers()
_WRITING: list[_Save] = []  # the same saves on every rank (each async save schedules one everywhere)
_PUBLISHING: list[tuple[int, concurrent.futures.Future]] = []  # rank 0's publications in flight


class _TensorFinder(pickle.Pickler):
    """Walks an object as ``torch.save`` does, listing its tensors (written nowhere)."""

    def __init__(self, file: io.BytesIO, tensors: list) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any) -> Optional[int]:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


def containers(obj: Any) -> Any:
    """A copy of `obj`'s containers and values holding the same (live) tensors: what training may change in place
    outside the saved tensors (a dict, a namespace) no longer reaches the save. (``copy.deepcopy`` with every tensor
    mapped to itself: it keeps the identity of strings, which ``torch.save``'s pickle memo records.)"""
    return copy.deepcopy(obj, {id(tensor): tensor for tensor in _tensors(obj, [])})


def _tensors(obj: Any, found: list) -> list:
    """Every tensor in `obj` as ``torch.save`` would reach it (through dicts, lists, tuples, objects' state)."""
    _TensorFinder(io.BytesIO(), found).dump(obj)
    return found


def snapshot(obj: Any) -> Any:
    """A copy of `obj` whose tensors own cloned storages (each storage once; views keep their offsets), so training
    can change the originals while the copy is written, and ``torch.save`` writes the copy's bytes exactly as it
    would write the originals'. The storages are cloned by tensor copies, which release the GIL (a storage's own
    clone holds it), and handed to ``copy.deepcopy`` through its storage memo."""
    storages: dict = {}
    for tensor in _tensors(obj, []):
        if tensor.layout != torch.strided or tensor.is_meta:
            continue  # copy.deepcopy copies it as it would have
        storage = tensor.untyped_storage()
        if storage._cdata not in storages:
            as_bytes = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            storages[storage._cdata] = as_bytes.clone().untyped_storage()
    return copy.deepcopy(obj, {"torch": storages})


def _copy_and_write(writes: list[tuple[Any, str]], save: Callable[[Any, str], None],
                    copied: threading.Event) -> None:
    """The background job: copy the live tensors (then training may change them), write the copies."""
    try:
        copies = [(snapshot(obj), path) for obj, path in writes]
    finally:
        copied.set()
    writes.clear()
    _write_all(copies, save)


def _write_all(writes: list[tuple[Any, str]], save: Callable[[Any, str], None]) -> None:
    for obj, path in writes:
        save(obj, path)


def schedule(iteration: int, writes: list[tuple[Any, str]], save: Callable[[Any, str], None],
             publish: Optional[Callable[[], None]], persistent: bool) -> None:
    """Copy and write each (state, path) of `writes` with `save` in the background (the states live: their
    containers are copied here, their tensors in the background before anything may change them,
    megatron/core/saved_state.py); `publish` (rank 0: what makes the checkpoint the latest) runs once every rank's
    writes are complete (`maybe_finalize`). Every rank calls this for every asynchronous save, with or without
    files to write."""
    writes = [(containers(obj), path) for obj, path in writes]
    copied = saved_state.begin_copy()
    future = _WRITERS.submit(lambda: _copy_and_write(writes, save, copied), persistent)
    _WRITING.append(_Save(iteration, future, publish, persistent))


def in_flight() -> bool:
    """Whether a save of this process is not yet published (rank 0) or not yet confirmed on every rank."""
    return bool(_WRITING or _PUBLISHING)


def _all_ranks(done: bool, failed: bool) -> tuple[bool, bool]:
    """(every rank done, some rank failed): one all-reduce over the world."""
    flags = torch.tensor([int(not done), int(failed)], dtype=torch.int32)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return not bool(flags[0].item()), bool(flags[1].item())


def _finish_writing(blocking: bool) -> None:
    """Collective: confirm the oldest save's writes on every rank; once confirmed, rank 0 publishes it."""
    while _WRITING:
        save = _WRITING[0]
        if blocking:
            concurrent.futures.wait([save.write])
        done = save.write.done()
        error = save.write.exception() if done else None
        all_done, failed = _all_ranks(done, error is not None)
        if failed:
            _WRITING.clear()
            if error is not None:
                raise error
            raise AsyncSaveError(f"the asynchronous checkpoint save of iteration {save.iteration} failed on another "
                                 "rank (its own error names the file); the previous checkpoint stays the latest")
        if not all_done:
            return
        _WRITING.pop(0)
        if save.publish is not None:
            _PUBLISHING.append((save.iteration, _WRITERS.submit(save.publish, save.persistent)))


def _finish_publishing(blocking: bool) -> None:
    """Rank 0, no collective: drop finished publications (raising a failed one's error); `blocking`: wait first."""
    while _PUBLISHING:
        _, future = _PUBLISHING[0]
        if blocking:
            concurrent.futures.wait([future])
        if not future.done():
            return
        _PUBLISHING.pop(0)
        future.result()


def maybe_finalize(blocking: bool = False) -> None:
    """Megatron's ``maybe_finalize_async_save``: publish the saves whose files every rank has written. Collective
    while a save is in flight (every rank must call it at the same points); a no-op otherwise. `blocking`: wait
    until every save is written and published (before the next save, at the end of training, before an exit)."""
    if blocking and in_flight():
        print0("finalizing the asynchronous checkpoint save(s) in flight (--async-save) ...")
    _finish_writing(blocking)
    _finish_publishing(blocking)


def abandon() -> list[int]:
    """After a failure that restarts the run inside its processes (--inprocess-restart): no collective can confirm
    the saves still being written, so they are never published (the latest checkpoint stays the last one every rank
    confirmed, which the restarted run loads). Their background jobs are waited for, so that no thread still writes
    when the run starts again; rank 0's publications of confirmed saves complete (a failed one is one line, not an
    error: the restart goes on from the previous checkpoint). Returns the abandoned saves' iterations."""
    abandoned = [save.iteration for save in _WRITING]
    concurrent.futures.wait([save.write for save in _WRITING])
    _WRITING.clear()
    for iteration, future in _PUBLISHING:
        error = future.exception()
        if error is not None:
            print(f"the asynchronous checkpoint of iteration {iteration} was not published: {error}", flush=True)
    _PUBLISHING.clear()
    return abandoned
