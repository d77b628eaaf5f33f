"""Load (and, in a plain checkout, compile on first use) the C++ dataset index helpers, plus slow references.

`get_helpers()` returns the compiled `megatron.data.helpers_cpp` module (csrc/helpers.cpp). `pip install -e .`
builds it; otherwise it is compiled once with pybind11 and the system C++ compiler into a cache directory
(`$MEGATRON_LITE_CACHE_DIR`, else `$XDG_CACHE_HOME/megatron-lite` or `~/.cache/megatron-lite`; the package directory
or a temp directory if that is not writable), guarded by a file lock so concurrent processes build it once.
Under torch.distributed use `compile_helpers_rank0(group)`: rank 0 builds, the others wait on a barrier.

`build_sample_idx` / `build_blending_indices` / `build_mapping` here forward to the compiled module, so
Megatron-style `from megatron.data import helpers; helpers.build_sample_idx(...)` works too.
`build_sample_idx_py` / `build_blending_indices_py` are slow, obviously-correct numpy/Python versions of the same
algorithms, used by the tests to check the C++ code.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import numpy as np

from megatron import optional
from megatron.data.file_lock import file_lock

MODULE_NAME = "megatron.data.helpers_cpp"
_SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "helpers.cpp"
_loaded: Optional[ModuleType] = None


def _ext_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _import_installed() -> Optional[ModuleType]:
    """The module built by setup.py, unless it is older than csrc/helpers.cpp in this checkout."""
    spec = importlib.util.find_spec(MODULE_NAME)
    if spec is None or spec.origin is None:
        return None
    if _SOURCE.is_file() and os.path.getmtime(spec.origin) < os.path.getmtime(_SOURCE):
        return None  # stale build from an older source; rebuild into the cache instead
    return importlib.import_module(MODULE_NAME)


def _candidate_dirs(tag: str) -> list[Path]:
    dirs = []
    env = os.environ.get("MEGATRON_LITE_CACHE_DIR")
    if env:
        dirs.append(Path(env) / "helpers" / tag)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron-lite"
    dirs.append(base / "helpers" / tag)
    dirs.append(Path(__file__).resolve().parent / "_helpers_build" / tag)
    dirs.append(Path(tempfile.gettempdir()) / f"megatron-lite-{os.getuid()}" / "helpers" / tag)
    return dirs


def _writable_dir(dirs: list[Path]) -> Path:
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d
    raise RuntimeError(f"no writable directory to build the dataset helpers in (tried {', '.join(map(str, dirs))}); "
                       "set MEGATRON_LITE_CACHE_DIR to a writable directory or run `pip install -e .`")


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name.split()[0]):
            return name
    raise RuntimeError("no C++ compiler found to build the dataset helpers (csrc/helpers.cpp): install g++ "
                       "(e.g. `apt-get install g++`) or set CXX, or install a prebuilt package with `pip install .`")


def _compile(out_path: Path) -> None:
    try:
        pybind11 = optional.pybind11()
    except ImportError as exc:
        raise RuntimeError("pybind11 is needed to build the dataset helpers: `pip install pybind11`") from exc
    cxx = _compiler()
    print(f"compiling dataset helpers ({_SOURCE.name} -> {out_path}) ...", file=sys.stderr, flush=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    includes = [pybind11.get_include(), sysconfig.get_paths()["include"]]
    cmd = [*cxx.split(), "-O3", "-shared", "-std=c++17", "-fPIC", "-fvisibility=hidden",
           *(f"-I{inc}" for inc in includes), str(_SOURCE), "-o", str(tmp)]
    if sys.platform == "darwin":
        cmd.insert(1, "-undefined")
        cmd.insert(2, "dynamic_lookup")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {_SOURCE} failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    os.replace(tmp, out_path)


def _load_from(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[MODULE_NAME] = module
    return module


def get_helpers() -> ModuleType:
    """Return the compiled helpers module, building it (once, under a file lock) if needed."""
    global _loaded
    if _loaded is not None:
        return _loaded
    module = _import_installed()
    if module is None:
        if not _SOURCE.is_file():
            raise RuntimeError(f"megatron.data.helpers_cpp is not installed and {_SOURCE} is missing: "
                               "reinstall megatron-lite with `pip install .`")
        tag = hashlib.sha256(_SOURCE.read_bytes() + sys.version.encode()).hexdigest()[:16]
        name = "helpers_cpp" + _ext_suffix()
        existing = [d / name for d in _candidate_dirs(tag) if (d / name).is_file()]
        if existing:
            module = _load_from(existing[0])
        else:
            build_dir = _writable_dir(_candidate_dirs(tag))
            with file_lock(build_dir / ".lock"):  # others wait here while one process compiles
                if not (build_dir / name).is_file():
                    _compile(build_dir / name)
            module = _load_from(build_dir / name)
    _loaded = module
    return module


def compile_helpers_rank0(group: Any = None) -> ModuleType:
    """Build the helpers on rank 0 of `group` (default: world) while the others wait, then load them everywhere.

    Without torch.distributed this is just `get_helpers()`.
    """
    dist = optional.torch_distributed()
    if not (dist.is_available() and dist.is_initialized()):
        return get_helpers()
    first = dist.get_rank() == (min(dist.get_process_group_ranks(group)) if group is not None else 0)
    error: Optional[BaseException] = None
    if first:
        try:
            get_helpers()
        except BaseException as exc:  # noqa: BLE001 - still reach the barrier so others do not hang
            error = exc
    dist.barrier(group=group)
    if error is not None:
        raise error
    return get_helpers()


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """Megatron's `helpers.build_sample_idx` (C++): [num_samples + 1, 2] (doc_idx position, offset) pairs."""
    return get_helpers().build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)


def build_blending_indices(dataset_index: np.ndarray, dataset_sample_index: np.ndarray, weights: np.ndarray,
                           num_datasets: int, size: int, verbose: bool) -> None:
    """Megatron's `helpers.build_blending_indices` (C++): fills the two output arrays in place."""
    get_helpers().build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size, verbose)


def build_mapping(docs: np.ndarray, sizes: np.ndarray, num_epochs: int, max_num_samples: int, max_seq_length: int,
                  short_seq_prob: float, seed: int, verbose: bool, min_num_sent: int) -> np.ndarray:
    """Megatron's `helpers.build_mapping` (C++): the BERT/T5 samples mapping, rows (first, end, target length)."""
    return get_helpers().build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob,
                                       seed, verbose, min_num_sent)


def build_sample_idx_py(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                        tokens_per_epoch: int) -> np.ndarray:
    """Reference for `build_sample_idx` over the flat token stream of the documents in doc_idx order.

    Sample i covers stream tokens [i * seq_length, (i + 1) * seq_length] (inclusive), so boundary i sits at stream
    position i * seq_length; it is reported as (position in doc_idx, offset) in the first document that ends after
    it (zero-length documents never hold a boundary), which is where Megatron's loop stops.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out_dtype = np.int32 if doc_idx.dtype == np.int32 else np.int64
    lengths = sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(lengths)  # token position just past each document in the stream
    out = np.zeros((num_samples + 1, 2), dtype=out_dtype)
    for i in range(1, num_samples + 1):
        last = i * seq_length  # global position of this boundary token (shared by two samples)
        # Megatron's loop stops at the first document whose cumulative end exceeds `last`
        pos = int(np.searchsorted(ends, last, side="right"))
        start = ends[pos] - lengths[pos]
        out[i] = (pos, last - start)
    return out


def build_blending_indices_py(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference for `build_blending_indices`: returns (dataset_index uint8, dataset_sample_index int64)."""
    weights = np.asarray(weights, dtype=np.float64)
    counts = [0] * len(weights)
    dataset_index = np.zeros(size, dtype=np.uint8)
    sample_index = np.zeros(size, dtype=np.int64)
    for i in range(size):
        progress = max(float(i), 1.0)
        errors = [float(w) * progress - c for w, c in zip(weights, counts)]
        best = max(range(len(weights)), key=lambda d: (errors[d], -d))  # first of the maxima
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index
