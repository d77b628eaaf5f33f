"""The T5 example scripts: valid bash, the t5_220m preset (Megatron's documented T5 shape), and
examples/pretrain_t5.sh training a tiny T5 (flags appended to the 220m preset override it) and saving a checkpoint,
pretrain_t5_distributed_with_mp.sh training it with TP=2 + SP x PP=2 (split rank 1, its defaults) on 4 torchrun
processes, the DeepSpeed script's command."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.interpreter import path_with_this_python
from tests.training._bert import session_bert_data

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPTS = ["pretrain_t5.sh", "pretrain_t5_distributed.sh", "pretrain_t5_distributed_with_mp.sh",
           "pretrain_t5_deepspeed.sh", "slurm/pretrain_t5.slurm", "t5_common.sh", "presets/t5_220m.sh",
           "presets/t5_tiny.sh"]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--kv-channels", "16",
        "--ffn-hidden-size", "256", "--encoder-seq-length", "64", "--decoder-seq-length", "32",
        "--max-position-embeddings", "64", "--train-iters", "2", "--lr-warmup-fraction", "0", "--log-interval", "1",
        "--eval-iters", "1", "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "4"]


@pytest.fixture(scope="module")
def t5_data(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return session_bert_data(shared_data, tmp_path_factory)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / script)], check=True)


def test_t5_220m_preset() -> None:
    text = " ".join((EXAMPLES / "presets" / "t5_220m.sh").read_text().replace("\\\n", " ").split())
    assert ("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --kv-channels 64 --ffn-hidden-size 3072 "
            "--encoder-seq-length 512 --decoder-seq-length 128 --max-position-embeddings 512 "
            "--vocab-extra-ids 100") in text


def _env(t5_data: dict, **extra: str) -> dict:
    env = dict(os.environ, PRESET="220m", DATA_PATH=t5_data["prefix"], VOCAB_FILE=t5_data["vocab"],
               OMP_NUM_THREADS="1", **extra)
    env["PATH"] = path_with_this_python(env["PATH"])  # `python` is this interpreter
    return env


def test_pretrain_t5_sh_runs_tiny(t5_data: dict, tmp_path: Path) -> None:
    env = _env(t5_data, CHECKPOINT_PATH=str(tmp_path / "ckpt"))
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_t5.sh"), *TINY], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " iteration        2/       2 |" in proc.stdout and "| lm loss: " in proc.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_with_mp_script_trains_tp2_pp2_and_deepspeed_command(t5_data: dict, tmp_path: Path) -> None:
    from tests.dist_utils import free_port

    env = _env(t5_data, CHECKPOINT_PATH=str(tmp_path / "mp"), MASTER_PORT=str(free_port()))
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_t5_distributed_with_mp.sh"), *TINY], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " iteration        2/       2 |" in proc.stdout
    assert "tensor-model-parallel size: 2, pipeline-model-parallel size: 2" in proc.stdout
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_t5_deepspeed.sh")], capture_output=True, text=True,
                          env=_env(t5_data, DRY_RUN="1", ZERO_STAGE="3", CHECKPOINT_PATH=str(tmp_path / "ds")),
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pretrain_t5.py" in proc.stdout and "--zero-stage 3" in proc.stdout
    assert '"stage": 3' in (tmp_path / "ds" / "ds_config.json").read_text()
