"""The example launch scripts: valid bash, presets complete, and examples/pretrain_gpt.sh trains a tiny GPT."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megatron.presets import get_preset
from tests.interpreter import path_with_this_python

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = ["pretrain_gpt.sh", "pretrain_gpt_distributed.sh", "pretrain_gpt_distributed_with_mp.sh", "gpt_common.sh",
           "slurm/pretrain_gpt.slurm"]
PRESETS = {"345m": (24, 1024, 16), "1.3b": (24, 2048, 16), "2.7b": (32, 2560, 32), "3.7b": (32, 3072, 32)}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / script)], check=True)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_define_the_standard_models(name: str) -> None:
    text = (EXAMPLES / "presets" / f"gpt_{name}.sh").read_text()
    layers, hidden, heads = PRESETS[name]
    assert f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads}" in text


def test_pretrain_gpt_sh_runs_tiny(gpt_data: dict, tmp_path: Path) -> None:
    env = dict(os.environ, PRESET="345m", DATA_PATH=gpt_data["prefix"], VOCAB_FILE=gpt_data["vocab"],
               MERGE_FILE=gpt_data["merges"], CHECKPOINT_PATH=str(tmp_path / "ckpt"), PATH=os.environ["PATH"])
    env["PATH"] = path_with_this_python(env["PATH"])  # `python` is this interpreter
    tiny = [*get_preset("gpt_test").argv(), "--train-iters", "2", "--lr-warmup-fraction", "0",
            "--log-interval", "1", "--eval-iters", "1", "--num-workers", "0", "--global-batch-size", "4"]
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_gpt.sh"), *tiny], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " iteration        2/       2 |" in proc.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert any((tmp_path / "ckpt" / "tensorboard").iterdir())


def test_missing_data_is_a_clear_error(tmp_path: Path) -> None:
    env = dict(os.environ, DATA_PATH=str(tmp_path / "nothing"))
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_gpt.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "missing" in proc.stderr and "DATA_PATH" in proc.stderr
