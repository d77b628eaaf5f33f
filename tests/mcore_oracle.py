"""NVIDIA megatron-core 0.16.1 as an oracle: find its folder and run a script against it in a subprocess.

Its top-level package is also named `megatron`, so it never enters this environment: `examples/install.sh --dev`
puts it in `.oracles/megatron-core-0.16.1/` (or `$MCORE_ORACLE_DIR`), and `run_oracle` starts a fresh interpreter
with only that folder on PYTHONPATH. Scripts exchange tensors through files in a temporary folder.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def oracle_dir() -> Path:
    """The folder holding megatron-core's `megatron/` package (installed by `examples/install.sh --dev`)."""
    env = os.environ.get("MCORE_ORACLE_DIR")
    return Path(env) if env else REPO_ROOT / ".oracles" / "megatron-core-0.16.1"


def require_oracle() -> Path:
    """The oracle's folder; fails (not skips) the test when it is missing, naming the command that installs it."""
    path = oracle_dir()
    if not (path / "megatron" / "core" / "__init__.py").is_file():
        pytest.fail(f"megatron-core oracle not found in {path}: run `bash examples/install.sh --dev`")
    return path


def run_oracle(script: str, cwd: Path, timeout: float = 600, nproc: int = 1) -> subprocess.CompletedProcess:
    """Run `script` (Python source) with megatron-core importable and this repository not; raise on failure.

    With nproc > 1 the script runs under torchrun (gloo) with nproc processes.
    """
    path = require_oracle()
    script_file = Path(cwd) / "_oracle_script.py"
    script_file.write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(path)
    env.setdefault("OMP_NUM_THREADS", "1")
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(script_file)]
    else:
        cmd = [sys.executable, str(script_file)]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"megatron-core oracle script failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


# Stand-ins for the CUDA-only calls megatron-core makes while building and running a model on CPU; an oracle script
# starts with `exec(ORACLE_CPU_PRELUDE)` (and keeps its work under `if __name__ == "__main__":`, since
# dist_checkpointing starts a worker process).
ORACLE_CPU_PRELUDE = '''
import contextlib as _contextlib
import torch as _torch
_torch.cuda.current_device = lambda: "cpu"          # its global memory buffer and RNG setup then live on the CPU
_torch.cuda.synchronize = lambda *a, **k: None
_torch.Tensor.cuda = lambda self, *a, **k: self     # tied embeddings over pipeline stages move a copy "to the GPU"
from megatron.core.tensor_parallel import random as _mcore_random


@_contextlib.contextmanager
def _no_fork(self, name=None):                       # the CUDA RNG tracker's fork: no CUDA generator to fork
    yield


_mcore_random.CudaRNGStatesTracker.fork = _no_fork
'''
