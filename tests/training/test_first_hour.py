"""A newcomer's first hour (issue 19): each friction point as a user meets it — the entry point as a subprocess, its
exit code and its one `error:` line — plus the README's DeepSpeed command passing start-up as written."""
from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.presets import get_preset
from tests.interpreter import path_with_this_python

REPO = Path(__file__).resolve().parents[2]
MODEL = get_preset("gpt_micro_test").argv()


def _run(*argv: str, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def trained(gpt_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 2-iteration checkpoint of a tiny GPT (pretrain_gpt.py as a subprocess)."""
    work = tmp_path_factory.mktemp("first_hour")
    tok = ["--vocab-file", gpt_data["vocab"], "--merge-file", gpt_data["merges"]]
    train = [*MODEL, *tok, "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
             "--data-path", gpt_data["prefix"], "--split", "100,0,0", "--eval-iters", "0", "--num-workers", "0",
             "--log-interval", "1", "--save", str(work / "ckpt"), "--load", str(work / "ckpt"), "--save-interval", "2"]
    proc = _run(sys.executable, str(REPO / "pretrain_gpt.py"), *train, "--train-iters", "2", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"dir": work, "train": train, "tok": tok, "ckpt": str(work / "ckpt")}


def test_all_missing_required_flags_in_one_line(tmp_path: Path) -> None:
    proc = _run(sys.executable, str(REPO / "pretrain_gpt.py"), cwd=tmp_path)
    line = _one_error_line(proc)
    for flag in ("--micro-batch-size", "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--max-position-embeddings", "--vocab-file", "--merge-file", "--train-iters (or --train-samples)",
                 "--data-path", "--lr"):
        assert flag in line, line
    assert "building GPT model" not in proc.stdout  # stopped at argument validation


def test_training_without_data_path_or_length_is_one_line(tmp_path: Path, shared_data: Path) -> None:
    owt = shared_data / "openwebtext-1000"
    proc = _run(sys.executable, str(REPO / "pretrain_gpt.py"), *MODEL, "--micro-batch-size", "2", "--lr", "1e-3",
                "--vocab-file", str(owt / "gpt2-tiny-vocab.json"), "--merge-file", str(owt / "gpt2-tiny-merges.txt"),
                cwd=tmp_path)
    line = _one_error_line(proc)
    assert line == "error: missing required flags: --train-iters (or --train-samples), --data-path (or " \
                   "--train-data-path)", line


def test_resume_with_changed_train_iters_says_samples(trained: dict) -> None:
    proc = _run(sys.executable, str(REPO / "pretrain_gpt.py"), *trained["train"], "--train-iters", "4",
                cwd=trained["dir"])
    line = _one_error_line(proc)
    # 2 iterations x global batch 2 = 4 samples in the checkpoint's schedule, 4 x 2 = 8 in this run's
    assert "decay samples 4 but this run's flags give 8" in line and "iterations x --global-batch-size" in line
    assert "--override-opt_param-scheduler" in line and "--use-checkpoint-opt_param-scheduler" in line


def test_generate_temperature_zero_is_greedy(trained: dict) -> None:
    (trained["dir"] / "prompts.txt").write_text("The quick brown fox\nHello\n")
    tool = str(REPO / "tools" / "generate_samples_gpt.py")
    base = [sys.executable, tool, *MODEL, *trained["tok"], "--load", trained["ckpt"], "--sample-input-file",
            "prompts.txt", "--out-seq-length", "6", "--micro-batch-size", "2"]
    outs = []
    for extra, name in ((["--greedy"], "greedy.jsonl"), (["--temperature", "0"], "t0.jsonl")):
        proc = _run(*base, *extra, "--sample-output-file", name, cwd=trained["dir"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append((trained["dir"] / name).read_text())
    assert outs[0] == outs[1] and outs[0].count("\n") == 2
    line = _one_error_line(_run(*base, "--temperature", "-1", cwd=trained["dir"]))
    assert line == "error: --temperature must be >= 0 (0 = greedy), got -1.0"
    line = _one_error_line(_run(*base, "--temperature", "0", "--top_p", "0.9", cwd=trained["dir"]))
    assert "--temperature 0 means greedy" in line


def test_layout_mismatch_names_a_reshard_command_that_works(trained: dict) -> None:
    """The TP-mismatch message names tools/checkpoint/convert.py; its command gives a TP=2 checkpoint (optimizer
    state included)."""
    from megatron.compat import CheckpointError, check_checkpoint_args

    work = trained["dir"]
    saved = type("A", (), {"tensor_model_parallel_size": 1})()
    current = type("A", (), {"tensor_model_parallel_size": 2})()
    path = str(work / "ckpt" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    with pytest.raises(CheckpointError) as exc:
        check_checkpoint_args(saved, current, path)
    message = str(exc.value)
    assert "\n" not in message and "reshard the checkpoint" not in message
    commands = re.findall(r"python (tools/checkpoint/convert\.py [^,]*?), then --load NEW --no-load-rng", message)
    assert len(commands) == 1, message
    for command in commands:
        argv = shlex.split(command.replace("NEW", str(work / "tp2")).replace(" N ", " 2 ").replace(" M", " 1"))
        proc = _run(sys.executable, str(REPO / argv[0]), *argv[1:], cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (work / "tp2" / "iter_0000002").iterdir() if p.is_dir()) == ["mp_rank_00", "mp_rank_01"]
    assert (work / "tp2" / "iter_0000002" / "mp_rank_01" / "distrib_optim.pt").is_file()


def test_readme_deepspeed_command_passes_startup_as_written() -> None:
    """The documented DeepSpeed command (docs/gpt.md's pretraining flags + docs/deepspeed.md's line) passes argument
    validation with examples/ds_config_gpt.json: the flags set the batch, and they equal the config's."""
    from megatron.arguments import build_parser, validate_args
    from megatron.settings.required_flags import TRAINING_RUN

    pages = [REPO / "README.md", REPO / "docs" / "gpt.md", REPO / "docs" / "deepspeed.md"]
    readme = "".join(page.read_text(encoding="utf-8") for page in pages)
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    pretrain = next(b for b in blocks if b.startswith("python pretrain_gpt.py"))
    ds = next(b for b in blocks if b.startswith("deepspeed --num_gpus"))
    flags = shlex.split(pretrain.replace("\\\n", " "))[2:]
    ds_line = shlex.split(ds.split("\nbash ")[0].replace("\\\n", " "))
    assert ds_line[:4] == ["deepspeed", "--num_gpus", "2", "pretrain_gpt.py"]
    rest = " ".join(ds_line[4:])
    assert rest.startswith("<model, data and output flags as above> ")
    argv = flags + shlex.split(rest.split("> ", 1)[1].replace("examples/", str(REPO / "examples") + "/"))
    args = build_parser().parse_args(argv)
    args.rank, args.world_size = 0, 2
    validate_args(args, {TRAINING_RUN: True, "tokenizer_type": "GPT2BPETokenizer"})
    cfg = args.deepspeed_config_dict
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["train_batch_size"], cfg["gradient_accumulation_steps"]) \
        == (1, 16, 8)


def test_example_script_without_gpu_picks_a_preset_that_runs(gpt_data: dict, tmp_path: Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "",  # no GPU, also on a machine that has one
           "DATA_PATH": gpt_data["prefix"], "VOCAB_FILE": gpt_data["vocab"], "MERGE_FILE": gpt_data["merges"],
           "CHECKPOINT_PATH": str(tmp_path / "ckpt"), "TRAIN_ITERS": "2", "LOG_INTERVAL": "1",
           "PATH": path_with_this_python()}
    env_all = {k: v for k, v in os.environ.items() if k != "PRESET"}
    proc = subprocess.run(["bash", str(REPO / "examples" / "pretrain_gpt.sh"), "--eval-iters", "0",
                           "--num-workers", "0", "--seq-length", "32", "--max-position-embeddings", "32"],
                          env={**env_all, **env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note: no GPU found")]
    assert len(notes) == 1 and "PRESET=tiny" in notes[0], proc.stderr[-2000:]
    assert " iteration        2/       2 |" in proc.stdout
    assert re.search(r"num_layers \.+ 4\b", proc.stdout) and re.search(r"hidden_size \.+ 128\b", proc.stdout)


def test_progress_is_plain_lines_when_not_a_terminal() -> None:
    from tasks.zeroshot_gpt.progress import progress

    stream = io.StringIO()
    assert list(progress(range(133), 133, stream=stream)) == list(range(133))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 10
    assert lines[0].startswith("evaluating: 14/133 batches (10%), ") and lines[-1].startswith("evaluating: 133/133")


def test_small_cli_and_config_papercuts() -> None:
    proc = _run(sys.executable, str(REPO / "tools" / "text_generation_cli.py"), "--help", cwd=REPO)
    assert proc.returncode == 0
    for flag in ("--tokens-to-generate", "--temperature", "--top-k", "--top-p"):
        after = proc.stdout.split(flag, 2)[-1]  # the option's line in the options list
        assert re.match(r" [A-Z_]+\s+\S", after.replace("\n", " ")), proc.stdout
    addopts = re.search(r'^addopts = "(.*)"$', (REPO / "pyproject.toml").read_text(), flags=re.M).group(1)
    assert "-q" not in addopts.split()  # a user's -q stays -q


def test_deepspeed_checkpoint_given_to_inference_names_the_conversion(tmp_path: Path, shared_data: Path) -> None:
    (tmp_path / "ds_ckpt").mkdir()
    (tmp_path / "ds_ckpt" / "latest").write_text("global_step2")
    owt = shared_data / "openwebtext-1000"
    proc = _run(sys.executable, str(REPO / "tools" / "generate_samples_gpt.py"), *MODEL, "--load", "ds_ckpt",
                "--vocab-file", str(owt / "gpt2-tiny-vocab.json"), "--merge-file", str(owt / "gpt2-tiny-merges.txt"),
                "--num-samples", "1", cwd=tmp_path)
    line = _one_error_line(proc)
    assert "python tools/convert_deepspeed_checkpoint.py --input-folder ds_ckpt --output-folder ds_ckpt_megatron, " \
           "then --load ds_ckpt_megatron" in line, line
