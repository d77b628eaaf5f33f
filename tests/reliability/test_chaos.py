"""Chaos test: a tiny run is SIGKILLed at 20 points across training steps and checkpoint writes — inside the write of
the model file, the manifest and the tracker (half the bytes on disk), before and after each rename, while
--keep-last-n-checkpoints deletes old iterations — each run resuming from what the previous one left. Every resume
must pick the newest verified checkpoint and reproduce the uninterrupted run's losses exactly (same log strings); the
final run completes, every kept iteration verifies and no temporary file remains.

The kills come from the env-controlled fault-injection hook of megatron/checkpoint/atomic_io.py (no sleeps, no timing); the runs
are forked from one pre-imported driver process (tests/reliability/_chaos_driver.py) to keep the test fast."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

from megatron.checkpoint import integrity
from tests.log_lines import iteration_lines, iteration_values
from tests.reliability.helpers import REPO, train_argv

ITERS = 12
LOAD_RE = re.compile(r" loading checkpoint from \S+ at iteration (\d+)")
MODEL, MANIFEST, TRACKER = "model_optim_rng.pt", "manifest.json", "latest_checkpointed_iteration.txt"
# Each run is killed at its first matching point, so progress is slow and every stage of a save is hit: the first
# ten kill the first save step by step, then steps, a rewrite of an iteration whose manifest exists but whose tracker
# never moved, and --keep-last-n-checkpoints deletions.
FAULTS = [
    "forward-step@2", f"mid-write:{MODEL}@1", f"before-rename:{MODEL}@1", f"after-rename:{MODEL}@1",
    f"mid-write:{MANIFEST}@1", f"before-rename:{MANIFEST}@1", f"after-rename:{MANIFEST}@1",
    f"mid-write:{TRACKER}@1", f"before-rename:{TRACKER}@1", f"after-rename:{TRACKER}@1",
    "forward-step@3", f"mid-write:{MODEL}@1", f"after-rename:{MANIFEST}@1", "prune:@1", "forward-step@1",
    f"before-rename:{TRACKER}@1", f"mid-write:{MANIFEST}@1", f"after-rename:{MODEL}@1", "prune:@1", "forward-step@4",
]


def test_sigkill_anywhere_resumes_exactly(tiny_data: dict, tmp_path: Path) -> None:
    common = train_argv(tiny_data, "--save-interval", "2", "--keep-last-n-checkpoints", "2", iters=ITERS)
    ref, chaos = str(tmp_path / "ref"), str(tmp_path / "chaos")
    runs = [{"argv": [*common, "--save", ref], "save": ref}]
    runs += [{"argv": [*common, "--save", chaos, "--load", chaos], "save": chaos, "fault": f} for f in FAULTS]
    runs.append({"argv": [*common, "--save", chaos, "--load", chaos], "save": chaos})
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"work": str(tmp_path), "runs": runs}))
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "tests.reliability._chaos_driver", str(plan), str(tmp_path / "r.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "r.json").read_text())

    reference = iteration_values(results[0]["stdout"], as_text=True)
    assert sorted(reference) == list(range(1, ITERS + 1)) and results[0]["signal"] == 0
    resumed_from = []
    for res in results[1:]:
        out = res["stdout"]
        if res["fault"] is not None:
            assert res["signal"] == signal.SIGKILL, (res["fault"], res["exit"], out[-2000:])
        else:
            assert res["exit"] == 0, out[-3000:]
        loads = [int(x) for x in LOAD_RE.findall(out)]
        if res["expected_resume"] is None:
            assert loads == [] and "start from random" in out
        else:
            assert loads == [res["expected_resume"]], (res["fault"], res["expected_resume"], out[-2000:])
            resumed_from.append(loads[0])
        for it, loss in iteration_lines(out, as_text=True):  # every step any run printed equals the uninterrupted run's
            assert loss == reference[int(it)], (res["fault"], it, loss, reference[int(it)])
    final = results[-1]
    assert sorted(i for i, _ in iteration_lines(final["stdout"]))[-1] == ITERS
    assert final["temps"] == [], final["temps"]
    root = Path(chaos)
    assert (root / TRACKER).read_text().strip() == str(ITERS)
    kept = integrity.iterations(chaos)
    assert kept[0] == ITERS and len(kept) == 2 and all(integrity.verify(str(integrity.iteration_dir(chaos, i))) is None
                                                        for i in kept)
    assert not [p for p in root.rglob("*") if ".tmp." in p.name]
    assert len(set(resumed_from)) >= 4, resumed_from  # the kills landed at different stages of the run
