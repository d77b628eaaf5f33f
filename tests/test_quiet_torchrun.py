"""Finetuning a small file with the example scripts' defaults (issue 29 item 5): examples/finetune_common.sh lowers
the micro-batch to fit (saying so) or stops before launching, and under megatron.quiet_torchrun a user error prints
one line, once, with exit code 1 and no torch elastic crash report, while a crash keeps the full report."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.presets import get_preset
from tests.dist_utils import free_port
from tests.interpreter import path_with_this_python

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures"
MNLI = FIX / "mnli-sample"


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PATH=path_with_this_python(env.get("PATH", "")), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
    return env


@pytest.mark.parametrize("gpus,expected", [("2", "--micro-batch-size 3 "), ("8", None)])
def test_mnli_script_fits_the_micro_batch_to_a_small_file(gpus: str, expected: str | None) -> None:
    env = _env(DRY_RUN="1", PRESET="tiny", GPUS_PER_NODE=gpus, TRAIN_DATA=str(MNLI / "train.tsv"))
    proc = subprocess.run(["bash", str(REPO / "examples" / "finetune_mnli_distributed.sh")], env=env,
                          capture_output=True, text=True, timeout=120)
    if expected:
        assert proc.returncode == 0 and expected in proc.stdout, proc.stderr
        assert "note: --train-data has 6 examples, fewer than one batch of 16" in proc.stderr
    else:
        assert proc.returncode == 1 and not proc.stdout, proc.stdout
        assert "error: --train-data has 6 examples, fewer than the 8 processes" in proc.stderr


@pytest.mark.slow
def test_user_error_under_torchrun_is_one_line(tmp_path: Path) -> None:
    argv = ["--task", "MNLI", "--train-data", str(MNLI / "train.tsv"), "--valid-data", str(MNLI / "dev_matched.tsv"),
            *get_preset("gpt_micro_test").argv(), "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
            str(FIX / "bert-wordpiece" / "bert-base-uncased-vocab.txt"), "--epochs", "1", "--micro-batch-size", "8",
            "--lr", "1e-4", "--distributed-backend", "gloo"]
    launch = [sys.executable, "-m", "megatron.quiet_torchrun", "--nproc_per_node", "2", "--master_port"]
    proc = subprocess.run([*launch, str(free_port()), str(REPO / "tasks" / "main.py"), *argv], env=_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["error: --train-data has 6 examples, fewer than one batch of 16: lower "
                                        "--micro-batch-size or pass --keep-last"], proc.stderr[-3000:]
    crash = tmp_path / "crash.py"
    crash.write_text("import os\nraise RuntimeError('boom on rank ' + os.environ['RANK'])\n")
    proc = subprocess.run([*launch, str(free_port()), str(crash)], env=_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "RuntimeError: boom on rank" in proc.stderr
    assert "ChildFailedError" in proc.stderr  # torchrun's report, kept for a crash
