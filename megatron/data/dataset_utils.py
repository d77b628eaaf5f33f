"""Shared helpers for the pretraining datasets: split parsing, blend weights, index-cache locations, rank-0 logging.

Megatron semantics: `--split 969,30,1` (or `969/30/1`) is normalised and turned into document boundaries;
`--data-path 0.3 a 0.7 b` gives weights and prefixes, and each component dataset is asked for 0.5% more samples
than its share so that the blend never runs short.
"""
from __future__ import annotations

import contextlib
import fcntl
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np

NumSamples = Union[int, Sequence[int]]


def _dist():
    """torch.distributed if it is initialised, else None (torch is imported lazily)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a hard dependency of training, not of this module
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def is_rank_0() -> bool:
    dist = _dist()
    return dist is None or dist.get_rank() == 0


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only (or always, without torch.distributed)."""
    if is_rank_0():
        print(message, flush=True)


def is_group_leader(group: Any = None) -> bool:
    """True on the lowest global rank of `group` (default: world), and always without torch.distributed."""
    dist = _dist()
    if dist is None:
        return True
    if group is None:
        return dist.get_rank() == 0
    return dist.get_rank() == min(dist.get_process_group_ranks(group))


def barrier(group: Any = None) -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier(group=group)


def get_train_valid_test_split_(splits_string: str, size: int) -> list[int]:
    """Document boundaries [0, a, b, size] from a "969,30,1" / "969/30/1" / "1" style split string."""
    text = str(splits_string).strip()
    sep = "," if "," in text else "/"
    try:
        splits = [float(s) for s in text.split(sep)] if text else []
    except ValueError as exc:
        raise ValueError(f"--split {splits_string!r}: expected up to three numbers like '969,30,1'") from exc
    if not splits or len(splits) > 3 or any(s < 0 for s in splits) or sum(splits) <= 0:
        raise ValueError(f"--split {splits_string!r}: expected up to three non-negative numbers with a positive sum")
    splits = (splits + [0.0, 0.0])[:3]
    total = sum(splits)
    splits = [s / total for s in splits]
    index = [0]
    for s in splits:
        index.append(index[-1] + int(round(s * float(size))))
    diff = index[-1] - size
    for i in range(1, len(index)):
        index[i] -= diff
    assert len(index) == 4 and index[-1] == size
    return index


def parse_data_prefix(data_prefix: Sequence[Any]) -> tuple[list[str], list[float]]:
    """Split `--data-path` into prefixes and normalised weights (one bare prefix gets weight 1)."""
    items = [str(x) for x in data_prefix]
    if len(items) == 1:
        return [items[0].strip()], [1.0]
    if len(items) % 2 != 0:
        raise ValueError(f"--data-path {' '.join(items)}: give one prefix, or pairs of weight and prefix "
                         "like '0.3 path/a_text_document 0.7 path/b_text_document'")
    prefixes, weights = [], []
    for i in range(0, len(items), 2):
        try:
            w = float(items[i])
        except ValueError as exc:
            raise ValueError(f"--data-path: expected a weight before {items[i + 1]!r}, got {items[i]!r}") from exc
        if w < 0 or not math.isfinite(w):
            raise ValueError(f"--data-path: weight {items[i]!r} for {items[i + 1]!r} must be a non-negative number")
        weights.append(w)
        prefixes.append(items[i + 1].strip())
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--data-path {' '.join(items)}: the weights must add up to a positive number")
    return prefixes, [w / total for w in weights]


def get_datasets_weights_and_num_samples(data_prefix: Sequence[Any], train_valid_test_num_samples: NumSamples
                                         ) -> tuple[list[str], list[float], list]:
    """Prefixes, normalised weights and per-dataset sample counts (share of the total, plus 0.5%, rounded up)."""
    prefixes, weights = parse_data_prefix(data_prefix)
    if isinstance(train_valid_test_num_samples, (list, tuple)):
        per_dataset = [[int(math.ceil(n * w * 1.005)) for n in train_valid_test_num_samples] for w in weights]
    else:
        per_dataset = [int(math.ceil(train_valid_test_num_samples * w * 1.005)) for w in weights]
    return prefixes, weights, per_dataset


def get_indexed_dataset_(data_prefix: str, data_impl: str, skip_warmup: bool):
    """Open the preprocessed `<prefix>.bin/.idx` pair with owner 2's reader, with Megatron's log lines."""
    from megatron.data.indexed_dataset import make_dataset

    print_rank_0(" > building dataset index ...")
    start = time.time()
    dataset = make_dataset(data_prefix, data_impl, skip_warmup)
    if dataset is None:
        raise ValueError(f"--data-path {data_prefix}: no indexed dataset found ({data_prefix}.bin / {data_prefix}.idx "
                         f"with --data-impl {data_impl}); run tools/preprocess_data.py first")
    print_rank_0(f" > finished creating indexed dataset in {time.time() - start:4f} seconds")
    print_rank_0(f"    number of documents: {dataset.sizes.shape[0]}")
    return dataset


def user_cache_dir() -> Path:
    """Fallback location for index caches when the data directory is read-only."""
    env = os.environ.get("MEGATRON_LITE_CACHE_DIR")
    if env:
        return Path(env) / "index-cache"
    home_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return home_cache / "megatron-lite" / "index-cache"


def index_cache_dirs(data_prefix: str, data_cache_path: Optional[str], *, for_search: bool = False) -> list[Path]:
    """Index-map cache directories for `data_prefix`: where to write (first writable one) or, with for_search,
    where to look. As Megatron, `<data dir>/index-cache` is searched before --data-cache-path (no duplicate
    caches), while new caches go to --data-cache-path when given; then a user cache dir and a temp dir."""
    default = Path(os.path.dirname(os.path.abspath(data_prefix))) / "index-cache"
    given = [Path(data_cache_path)] if data_cache_path else []
    dirs = [default, *given] if for_search else [*given, default]
    dirs.append(user_cache_dir())
    dirs.append(Path(tempfile.gettempdir()) / f"megatron-lite-{os.getuid()}" / "index-cache")
    return dirs


def first_writable_dir(dirs: Sequence[Path]) -> Path:
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK | os.X_OK):
            return d
    raise RuntimeError(f"no writable directory for the dataset index cache (tried {', '.join(map(str, dirs))}); "
                       "pass --data-cache-path DIR with a directory you can write to")


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save to a temporary name in the same directory, then rename (readers never see partial files)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npy")
    np.save(tmp, array, allow_pickle=True)
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on `path` (created if needed); a no-op where the filesystem has no flock support.

    Without the lock, concurrent builders still produce correct files (the contents are deterministic and every
    file is renamed into place atomically); the lock only avoids doing the work twice.
    """
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
