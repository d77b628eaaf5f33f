"""SLURM preemption end to end: examples/slurm/pretrain_gpt_requeue.slurm (with stand-in `srun`/`scontrol` on PATH)
gets USR1 mid-run, SIGTERMs the training (--exit-signal-handler), which saves a checkpoint that verifies against its
manifest and exits 0; the script requeues the job, and the requeued run resumes from that checkpoint and reproduces the
uninterrupted run's losses exactly."""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

from megatron.checkpoint import integrity
from megatron.presets import get_preset
from tests.dist_utils import free_port
from tests.interpreter import path_with_this_python
from tests.log_lines import iteration_values
from tests.reliability.helpers import REPO

SCRIPT = REPO / "examples" / "slurm" / "pretrain_gpt_requeue.slurm"
TINY = [*get_preset("gpt_micro_test").argv(), "--micro-batch-size", "2", "--global-batch-size", "2",
        "--lr-warmup-fraction", "0", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
ITERS = 12


def _env(tiny_data: dict, tmp_path: Path, ckpt: str) -> dict:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    (stubs / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    for stub in ("srun", "scontrol"):
        (stubs / stub).chmod(0o755)
    return {**os.environ, "PATH": f"{stubs}{os.pathsep}{path_with_this_python()}", "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(REPO), "PRESET": "345m",
            "DATA_PATH": tiny_data["prefix"], "VOCAB_FILE": tiny_data["vocab"], "MERGE_FILE": tiny_data["merges"],
            "CHECKPOINT_PATH": str(tmp_path / ckpt), "TRAIN_ITERS": str(ITERS), "LR_DECAY_ITERS": str(ITERS),
            "SAVE_INTERVAL": "1000", "EVAL_INTERVAL": "1000",
            "MASTER_PORT": str(free_port())}  # the script's default 6000 may be another run's on this machine


def _losses(text: str) -> dict[int, str]:
    return iteration_values(text, as_text=True)


def test_usr1_saves_requeues_and_resumes_exactly(tiny_data: dict, tmp_path: Path) -> None:
    ref = subprocess.run(["bash", str(SCRIPT), *TINY], env=_env(tiny_data, tmp_path, "ref"), capture_output=True,
                         text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = _losses(ref.stdout)
    assert sorted(reference) == list(range(1, ITERS + 1))
    assert not (tmp_path / "scontrol.log").exists()  # a finished run is not requeued

    env = _env(tiny_data, tmp_path, "ckpt")
    # Every stdout line is read through one file object: communicate() after a `break` reads the pipe directly and
    # would lose the lines this object had already buffered (iteration 4 when it arrived with 3). stderr goes to a file.
    with open(tmp_path / "stderr.log", "w") as stderr:
        proc = subprocess.Popen(["bash", str(SCRIPT), *TINY], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if re.match(r" iteration +3/", line):
                proc.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@90` delivers to the batch script
        proc.wait(timeout=300)
    out, err = "".join(lines), (tmp_path / "stderr.log").read_text()
    assert proc.returncode == 0, err[-3000:]
    assert "requeueing job 4242" in out and (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < ITERS and max(_losses(out)) == saved
    assert integrity.verify(str(integrity.iteration_dir(str(tmp_path / "ckpt"), saved))) is None

    again = subprocess.run(["bash", str(SCRIPT), *TINY], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = _losses(again.stdout)
    assert sorted(resumed) == list(range(saved + 1, ITERS + 1))
    assert all(resumed[i] == reference[i] for i in resumed)
    assert all(_losses(out)[i] == reference[i] for i in range(1, saved + 1))
