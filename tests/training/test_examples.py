"""The example launch scripts: valid bash, presets complete, examples/pretrain_gpt.sh trains a tiny GPT, and the GPT,
Mixtral and BLOOM scripts fit a short run (TRAIN_ITERS=20) as the docs show it."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron.presets import get_preset
from tests.interpreter import path_with_this_python
from tests.log_lines import iteration_lines, iteration_values

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = ["pretrain_gpt.sh", "pretrain_gpt_distributed.sh", "pretrain_gpt_distributed_with_mp.sh", "gpt_common.sh",
           "slurm/pretrain_gpt.slurm"]
PRESETS = {"345m": (24, 1024, 16), "1.3b": (24, 2048, 16), "2.7b": (32, 2560, 32), "3.7b": (32, 3072, 32)}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / script)], check=True)


def test_every_example_shell_file_is_valid_bash() -> None:
    """Every script and sourced file under examples/ (common.sh included: `bash -n` does not follow `source`)."""
    files = sorted(str(p) for p in [*EXAMPLES.rglob("*.sh"), *EXAMPLES.rglob("*.slurm")])
    assert any(f.endswith("/common.sh") for f in files)
    for f in files:
        proc = subprocess.run(["bash", "-n", f], capture_output=True, text=True)
        assert proc.returncode == 0, f"{f}: {proc.stderr}"


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


def _bash(script: str) -> list[str]:
    proc = subprocess.run(["bash", "-c", f'set -eu; source "{EXAMPLES}/common.sh"; {script}'], capture_output=True,
                          text=True, env={"PATH": os.environ["PATH"]}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_run_length_fits_short_runs_and_keeps_what_the_user_set() -> None:
    """fit_run_length (examples/common.sh): a 20-iteration run of a preset made for 300 decays over 20, warms up over
    2 and logs every 5; values the user set, and a long run's preset values, stay; --train-iters among the flags wins;
    --context-parallel-size 2 turns attention dropout off (with a note) unless ATTENTION_DROPOUT is set."""
    preset = 'f=$(mktemp); echo ": \\${LR_DECAY_ITERS:=300} \\${LR_WARMUP_ITERS:=20} \\${LOG_INTERVAL:=25}" > $f'
    show = 'echo $TRAIN_ITERS $LR_DECAY_ITERS $LR_WARMUP_ITERS $LOG_INTERVAL'
    assert _bash(f"{preset}; load_preset $f x; TRAIN_ITERS=20; fit_run_length; {show}") == ["20", "20", "2", "5"]
    assert _bash(f"{preset}; load_preset $f x; TRAIN_ITERS=1000; fit_run_length; {show}") == \
        ["1000", "300", "20", "25"]
    assert _bash(f"{preset}; load_preset $f x; TRAIN_ITERS=9; fit_run_length --lr 1 --train-iters 3; {show}") == \
        ["3", "3", "0", "1"]
    assert _bash(f"{preset}; LOG_INTERVAL=7 LR_WARMUP_ITERS=4; load_preset $f x; TRAIN_ITERS=20; fit_run_length; "
                 f"{show}") == ["20", "20", "4", "7"]
    assert _bash("context_parallel_dropout --context-parallel-size 2 2>/dev/null") == ["--attention-dropout", "0"]
    assert _bash("context_parallel_dropout --tensor-model-parallel-size 2") == []
    assert _bash("ATTENTION_DROPOUT=0.1 context_parallel_dropout --context-parallel-size 2") == \
        ["--attention-dropout", "0.1"]


@pytest.fixture(scope="module")
def hf_tokenizer(gpt_data: dict, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tokenizer.json folder with gpt_data's BPE (the ids gpt_data holds), for the BLOOM and Mixtral scripts: made
    as docs/gpt.md makes one from the quick-start's vocab.json + merges.txt."""
    from transformers import GPT2TokenizerFast

    bpe, folder = tmp_path_factory.mktemp("bpe"), tmp_path_factory.mktemp("hf_tokenizer")
    shutil.copy(gpt_data["vocab"], bpe / "vocab.json")
    shutil.copy(gpt_data["merges"], bpe / "merges.txt")
    GPT2TokenizerFast.from_pretrained(bpe).save_pretrained(folder)
    return str(folder)


SHORT_RUNS = {  # script: (environment, flags, the preset's MIN_LR, which the LR reaches at the run's end)
    "pretrain_gpt.sh": ({"PRESET": "tiny"}, ["--seq-length", "32", "--max-position-embeddings", "32"], 1e-4),
    "pretrain_mixtral.sh": ({"PRESET": "mixtral_tiny", "TOKENIZER_TYPE": "HuggingFaceTokenizer"}, [], 6e-5),
    "pretrain_bloom.sh": ({"PRESET": "bloom_tiny"}, [], 1e-4),
    "pretrain_gpt_oss.sh": ({"PRESET": "gpt_oss_tiny", "TOKENIZER_TYPE": "HuggingFaceTokenizer"}, [], 6e-5),
    "pretrain_qwen3.sh": ({"PRESET": "qwen3_moe_tiny", "TOKENIZER_TYPE": "HuggingFaceTokenizer"}, [], 6e-5),
}


@pytest.mark.parametrize("script", sorted(SHORT_RUNS))
def test_scripts_with_train_iters_20_log_and_decay_over_the_run(script: str, gpt_data: dict, hf_tokenizer: str,
                                                                tmp_path: Path) -> None:
    """`TRAIN_ITERS=20 bash examples/<script>` as the docs write it: loss lines every 5 iterations (the tiny presets
    log every 10-25), the warmup fits (bloom_tiny's 20 would be refused) and the LR has decayed to the preset's
    minimum at iteration 20 (the tiny GPT preset decayed over 300)."""
    extra, flags, min_lr = SHORT_RUNS[script]
    env = {k: v for k, v in os.environ.items() if k not in ("PRESET", "LOG_INTERVAL", "LR_DECAY_ITERS")}
    env.update(extra, TRAIN_ITERS="20", DATA_PATH=gpt_data["prefix"], VOCAB_FILE=gpt_data["vocab"],
               MERGE_FILE=gpt_data["merges"], TOKENIZER_MODEL=hf_tokenizer, TOKENIZER_NAME_OR_PATH=hf_tokenizer,
               CHECKPOINT_PATH=str(tmp_path / "ckpt"), SEQ_LENGTH="32", MICRO_BATCH_SIZE="2", GLOBAL_BATCH_SIZE="2",
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PATH=path_with_this_python())
    proc = subprocess.run(["bash", str(EXAMPLES / script), *flags, "--eval-iters", "1", "--num-workers", "0"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [it for it, _ in iteration_lines(proc.stdout)] == [5, 10, 15, 20], proc.stdout[-3000:]
    assert all(0 < loss < 12 for _, loss in iteration_lines(proc.stdout))
    assert iteration_values(proc.stdout, "learning rate")[20] == pytest.approx(min_lr, rel=1e-3)
