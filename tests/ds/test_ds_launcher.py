"""Issue 6's exact command under the real ``deepspeed --num_gpus 2`` launcher on CPU, and the DeepSpeed examples.

The run uses the issue's flags and sizes (2 layers, hidden 64, seq 1024, --train-samples 100, rampup 2 2 1_000, ZeRO-1,
--checkpoint-activations + --deepspeed-activation-checkpointing, --fp16 which the CPU run replaces by fp32 with a
notice) with examples/ds_config_gpt.json and data made by tools/preprocess_data.py; it must finish, log the loss,
write TensorBoard scalars (lm loss, batch-size, iteration time, validation ppl) and a DeepSpeed checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import free_port
from tests.log_lines import iteration_values

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def issue_flags(vocab: str, merges: str, data: str, save: str, tensorboard: str, ds_config: str) -> list[str]:
    """The command line of issue 6, flag for flag (paths filled in)."""
    return shlex.split(f"""
      --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
      --num-layers 2 --hidden-size 64 --num-attention-heads 2 --seq-length 1024 --max-position-embeddings 1024
      --micro-batch-size 1 --rampup-batch-size 2 2 1_000 --global-batch-size 16 --train-samples 100
      --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --lr 1e-4 --lr-warmup-samples 5
      --clip-grad 1.0 --weight-decay 1e-1 --vocab-file {vocab} --merge-file {merges} --fp16
      --log-interval 10 --save-interval 100 --eval-interval 100 --eval-iters 10 --checkpoint-activations
      --save {save} --load {save} --data-path {data} --tensorboard-dir {tensorboard} --tensorboard-queue-size 5
      --log-timers-to-tensorboard --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard
      --deepspeed --deepspeed_config {ds_config} --zero-stage 1 --deepspeed-activation-checkpointing
    """)


def _deepspeed_launcher() -> list[str]:
    """The `deepspeed` console script of this interpreter (python -m deepspeed.launcher.runner if it is missing)."""
    script = Path(sys.executable).parent / "deepspeed"
    if script.is_file():
        return [str(script)]
    found = shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]


def _preprocess(shared_data: Path, out_dir: Path) -> tuple[str, str, str]:
    owt = shared_data / "openwebtext-1000"
    vocab, merges = str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt")
    docs = out_dir / "owt100.jsonl"
    with open(owt / "openwebtext-1000.jsonl") as src, open(docs, "w") as dst:
        for i, line in enumerate(src):
            if i >= 100:
                break
            dst.write(line)
    subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(docs),
                    "--output-prefix", str(out_dir / "owt"), "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", "1"],
                   check=True, capture_output=True, text=True, cwd=REPO)
    return vocab, merges, str(out_dir / "owt_text_document")


def test_issue_command_runs_under_deepspeed_launcher(shared_data: Path, tmp_path: Path) -> None:
    vocab, merges, data = _preprocess(shared_data, tmp_path)
    save, tb = tmp_path / "checkpoints", tmp_path / "tensorboard"
    flags = issue_flags(vocab, merges, data, str(save), str(tb), str(EXAMPLES / "ds_config_gpt.json"))
    cmd = [*_deepspeed_launcher(), "--num_gpus", "2", "--master_port", str(free_port()), "pretrain_gpt.py", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]

    # The launcher started two ranks; fp16 was replaced by fp32 with a one-line notice on this CPU machine.
    assert "dist_world_size=2" in log
    if not torch.cuda.is_available():
        assert re.search(r"notice: fp16 .*fp32", proc.stdout), proc.stdout[:3000]
    # 100 samples at the ramp's starting global batch of 2 = 50 iterations, logged every 10.
    losses = iteration_values(proc.stdout)
    assert sorted(losses) == [10, 20, 30, 40, 50], proc.stdout[-3000:]
    assert all(math.isfinite(v) for v in losses.values()) and losses[50] < losses[10]
    assert " iteration       50/      50 | consumed samples:          100 |" in proc.stdout
    assert "global batch size:     2 |" in proc.stdout
    assert "validation loss at the end of training for val data" in proc.stdout

    # DeepSpeed checkpoint of the last iteration (saved at the end of training) with our client state.
    assert (save / "latest").read_text().strip() == "global_step50"
    step = save / "global_step50"
    names = sorted(os.listdir(step))
    assert "mp_rank_00_model_states.pt" in names
    assert [n for n in names if n.endswith("_optim_states.pt")] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    state = torch.load(step / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert state["iteration"] == 50 and state["args"].consumed_train_samples == 100
    assert state["module"]["language_model.embedding.position_embeddings.weight"].shape == (1024, 64)

    # The converted checkpoint feeds tools/generate_samples_gpt.py (the tool chain after DeepSpeed training).
    convert = subprocess.run([sys.executable, str(REPO / "tools" / "convert_deepspeed_checkpoint.py"),
                              "--input-folder", str(save), "--output-folder", str(tmp_path / "megatron")],
                             capture_output=True, text=True, cwd=REPO)
    assert convert.returncode == 0, convert.stderr[-2000:]
    (tmp_path / "prompts.txt").write_text("The first thing\n")
    gen = subprocess.run([sys.executable, str(REPO / "tools" / "generate_samples_gpt.py"),
                          *shlex.split("--num-layers 2 --hidden-size 64 --num-attention-heads 2 --seq-length 1024 "
                                       "--max-position-embeddings 1024"),
                          "--vocab-file", vocab, "--merge-file", merges, "--load", str(tmp_path / "megatron"),
                          "--sample-input-file", str(tmp_path / "prompts.txt"), "--sample-output-file",
                          str(tmp_path / "samples.jsonl"), "--out-seq-length", "8", "--greedy"],
                         capture_output=True, text=True, cwd=REPO, env=env)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert "successfully loaded checkpoint" in gen.stdout and "at iteration 50" in gen.stdout
    sample = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"] == "The first thing" and len(sample["tokens"]) == 8

    # TensorBoard: training loss every iteration, batch size (the ramp's 2), timers, validation loss and ppl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "batch-size", "iteration-time", "learning-rate", "lm loss validation",
                "lm loss validation ppl", "lm loss vs samples"):
        assert tag in scalars, sorted(scalars)
    assert [e.step for e in acc.Scalars("lm loss")] == list(range(1, 51))
    assert {e.value for e in acc.Scalars("batch-size")} == {2.0}
    ppl = acc.Scalars("lm loss validation ppl")[-1].value
    assert math.isclose(math.log(ppl), acc.Scalars("lm loss validation")[-1].value, rel_tol=1e-4)


# ---------------------------------------------------------------------------------------------- example files
DS_SCRIPTS = ["pretrain_gpt_single_node.sh", "slurm/pretrain_gpt_deepspeed.slurm",
              "slurm/pretrain_gpt_srun_torchrun.slurm"]


@pytest.mark.parametrize("script", DS_SCRIPTS)
def test_deepspeed_scripts_are_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / script)], check=True)


def test_ds_configs_are_the_issue_configs() -> None:
    cfg = json.loads((EXAMPLES / "ds_config_gpt.json").read_text())
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["train_batch_size"], cfg["gradient_clipping"]) == (1, 16, 1.0)
    assert cfg["zero_optimization"]["stage"] == 1
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                           "min_loss_scale": 1, "initial_scale_power": 12}
    tutorial = json.loads((EXAMPLES / "ds_config_gpt_tp4_zero3.json").read_text())
    assert tutorial["zero_optimization"]["stage"] == 3 and tutorial["zero_optimization"]["cpu_offload"] is True


def test_single_node_script_writes_outside_the_tree_by_default() -> None:
    """Without OUT the script's output goes to runs/ds_single_node/, which git ignores."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {  # a given DS_CONFIG: nothing is written
        "DRY_RUN": "1", "DS_CONFIG": str(EXAMPLES / "ds_config_gpt.json")}
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_gpt_single_node.sh")], env=env, capture_output=True,
                          text=True, check=True, cwd=REPO)
    argv = shlex.split(proc.stdout)
    save = argv[argv.index("--save") + 1]
    assert save == "runs/ds_single_node/checkpoints"
    if (REPO / ".git").exists():
        assert subprocess.run(["git", "check-ignore", "-q", save], cwd=REPO).returncode == 0


def test_single_node_script_runs_the_issue_command(tmp_path: Path) -> None:
    """DRY_RUN=1 prints the launcher command: the issue's flags (with this script's paths) plus extra arguments."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), DRY_RUN="1", MASTER_PORT="29555")
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_gpt_single_node.sh"), "--seed", "7"], env=env,
                          capture_output=True, text=True, check=True)
    argv = shlex.split(proc.stdout)
    assert argv[:6] == ["deepspeed", "--num_gpus", "2", "--master_port", "29555", "pretrain_gpt.py"]

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    out = tmp_path / "out"
    expected = issue_flags(value("--vocab-file"), value("--merge-file"), value("--data-path"), str(out / "checkpoints"),
                           str(out / "tensorboard"), str(out / "ds_config.json"))
    # ... except that the script's batch-size ramp (2 -> 16 over 56 samples) finishes within its 200 samples, and
    # it evaluates 2 batches (issue 6: a 1,000-sample ramp never finished in 100 samples).
    changes = {("--rampup-batch-size", 2): "56", ("--train-samples", 0): "200", ("--eval-iters", 0): "2"}
    for (flag, offset), new_value in changes.items():
        expected[expected.index(flag) + 1 + offset] = new_value
    ramp = argv[argv.index("--rampup-batch-size") + 1: argv.index("--rampup-batch-size") + 4]
    assert int(ramp[2]) < int(value("--train-samples"))

    def pairs(args: list[str]) -> set:
        result, key = set(), None
        for a in args:
            if a.startswith("--"):
                key = a
                result.add((a, None))
            else:
                result.add((key, a))
        return result

    assert pairs(argv[6:-2]) == pairs(expected)
    assert argv[-2:] == ["--seed", "7"]
    written = json.loads((out / "ds_config.json").read_text())
    assert written == json.loads((EXAMPLES / "ds_config_gpt.json").read_text()) | {"bf16": {"enabled": False}}
