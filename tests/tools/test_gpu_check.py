"""tools/gpu_check.sh starts and finishes on a machine without a GPU: its dry run skips every `gpu` test with the
reason, runs the benchmark's sections on the CPU (smoke mode) and writes the JSON + text report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--dry-run", "--quick", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] and report["quick"]
    tests = report["tests"]
    assert tests["failed"] == 0 and tests["passed"] == 0 and tests["skipped"] >= 15, tests  # --quick deselects a few
    assert set(tests["skip_reasons"]) == {"needs CUDA: no GPU on this machine"}, tests["skip_reasons"]
    bench = report["benchmark"]
    assert bench["smoke"] and bench["device"]["cuda"] is False
    for section in ("matmul_peak", "megatron", "hf", "profile", "kernels"):
        assert "error" not in bench[section] and "skipped" not in bench[section], (section, bench[section])
    assert bench["megatron"]["tokens_per_s"] > 0 and bench["hf"]["ours_over_hf"] > 0
    assert bench["generation"] == {"skipped": "--quick"}
    assert (out / "profile.txt").read_text().strip()
    text = (out / "gpu_check.txt").read_text()
    assert text.startswith("gpu check (quick, dry run): ") and f"{tests['skipped']} skipped" in text
