"""The BERT example scripts: valid bash, the bert_345m preset, examples/pretrain_bert.sh trains a tiny BERT and saves a
checkpoint, the DeepSpeed script's command, and the quick-start's BERT leg (own WordPiece vocabulary, sentence-split
data, lm loss going down)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megatron.presets import get_preset
from tests.interpreter import path_with_this_python
from tests.training._bert import session_bert_data

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPTS = ["pretrain_bert.sh", "pretrain_bert_distributed.sh", "pretrain_bert_distributed_with_mp.sh",
           "pretrain_bert_deepspeed.sh", "bert_common.sh", "quickstart_bert.sh", "slurm/pretrain_bert.slurm"]
TINY = [*get_preset("bert_test").argv(), "--train-iters", "2", "--lr-warmup-fraction", "0", "--log-interval", "1",
        "--eval-iters", "1", "--num-workers", "0", "--global-batch-size", "4"]


@pytest.fixture(scope="module")
def bert_data(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return session_bert_data(shared_data, tmp_path_factory)


def _env(**extra: str) -> dict:
    env = dict(os.environ, **extra)
    env["PATH"] = path_with_this_python(env["PATH"])  # `python` is this interpreter
    return env


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / script)], check=True)


def test_bert_345m_preset() -> None:
    text = (EXAMPLES / "presets" / "bert_345m.sh").read_text()
    assert ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 "
            "--max-position-embeddings 512") in text


def test_pretrain_bert_sh_runs_tiny_and_deepspeed_command(bert_data: dict, tmp_path: Path) -> None:
    env = _env(PRESET="345m", DATA_PATH=bert_data["prefix"], VOCAB_FILE=bert_data["vocab"],
               CHECKPOINT_PATH=str(tmp_path / "ckpt"))
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_bert.sh"), *TINY], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " iteration        2/       2 |" in proc.stdout and "| sop loss: " in proc.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"

    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_bert_deepspeed.sh")], capture_output=True, text=True,
                          env=_env(DRY_RUN="1", ZERO_STAGE="2", DATA_PATH=bert_data["prefix"],
                                   VOCAB_FILE=bert_data["vocab"], CHECKPOINT_PATH=str(tmp_path / "ds")), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pretrain_bert.py" in proc.stdout and "--zero-stage 2" in proc.stdout
    assert '"stage": 2' in (tmp_path / "ds" / "ds_config.json").read_text()


def test_quickstart_bert_leg(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(EXAMPLES / "quickstart.sh"), "bert"], capture_output=True, text=True,
                          env=_env(OUT=str(tmp_path / "qs"), BERT_TRAIN_ITERS="20", LOG_INTERVAL="10", SKIP_INSTALL="1"),
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "BERT training OK: lm loss" in proc.stdout
    assert (tmp_path / "qs" / "bert_data" / "python_docs_text_sentence.idx").is_file()
