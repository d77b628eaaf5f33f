"""Shared pieces of the GPU tests (tests/gpu/): the `gpu` marks (skip cleanly without CUDA), a single-process NCCL
pretrain_gpt runner in a fresh interpreter, and the log-line parser for loss scale and skipped iterations."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA: no GPU on this machine")]
ITER_RE = re.compile(r"^ iteration +(\d+)/ *\d+ \|")


def _field(line: str, name: str) -> str | None:
    m = re.search(rf"\| {name}: +([^|]+?) \|", line)
    return m.group(1) if m else None


def parse_log(stdout: str) -> dict[int, dict[str, float | None]]:
    """{iteration: {'loss', 'scale', 'skipped', 'grad_norm'}} from Megatron's training log lines."""
    out = {}
    for line in stdout.splitlines():
        m = ITER_RE.match(line)
        if m:
            vals = {k: _field(line, f) for k, f in (("loss", "lm loss"), ("scale", "loss scale"),
                                                    ("skipped", "number of skipped iterations"),
                                                    ("grad_norm", "grad norm"))}
            out[int(m.group(1))] = {k: float(v) if v is not None else None for k, v in vals.items()}
    return out


def free_port() -> int:
    from tests.dist_utils import free_port as port

    return port()


def pretrain_runs(runs: list[list[str]], tmp: Path, env: dict | None = None, timeout: int = 600) -> list[dict]:
    """pretrain_gpt.main(argv) for each argv, one after another in one fresh single-rank process (NCCL on CUDA,
    DeepSpeed's CUDA accelerator): [{'stdout', 'result', 'error', 'log'}], `log` = parse_log(stdout)."""
    spec, out = tmp / "runs.json", tmp / "results.json"
    spec.write_text(json.dumps(runs))
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cuda",
                **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "tests.gpu._runner", str(spec), str(out)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for r in results:
        r["log"] = parse_log(r["stdout"])
    return results


def check_ok(result: dict[str, Any]) -> None:
    assert result["error"] is None, result["error"] + "\n" + result["stdout"][-3000:]
