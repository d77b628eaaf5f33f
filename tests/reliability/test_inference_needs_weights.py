"""Inference refuses to serve noise: a --load that holds no checkpoint is one `error:` line and exit code 1 for the
REST server, generation and evaluation (training keeps Megatron's start-from-scratch, with a warning)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.helpers import MODEL, assert_one_line_error, run, train_argv


@pytest.mark.parametrize("tool, extra", [
    ("tools/generate_samples_gpt.py", ["--sample-input-file", "prompts.txt", "--out-seq-length", "4", "--greedy"]),
    ("tools/run_text_generation_server.py", ["--port", "0"]),
    ("tasks/main.py", ["--task", "WIKITEXT103", "--valid-data", "wiki.txt", "--micro-batch-size", "1"]),
])
def test_inference_without_checkpoint_is_one_line(tiny_data: dict, tmp_path: Path, tool: str, extra: list) -> None:
    (tmp_path / "prompts.txt").write_text("Hello\n")
    (tmp_path / "wiki.txt").write_text(" = Title = \n\n Some text for the model to score .\n")
    (tmp_path / "empty").mkdir()
    proc = run(tool, *MODEL, *tiny_data["tokenizer"], "--load", "empty", *extra, cwd=tmp_path)
    assert_one_line_error(proc, "--load empty holds no checkpoint", "random weights")


def test_training_starts_from_scratch_with_a_warning(tiny_data: dict, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, "--load", "empty", iters=1), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "will not load any checkpoints and will start from random" in proc.stdout


@pytest.mark.parametrize("tool, extra, what", [
    ("tools/generate_samples_gpt.py", ["--sample-input-file", "prompts.txt", "--out-seq-length", "4", "--greedy"],
     "generation"),
    ("tasks/main.py", ["--task", "WIKITEXT103", "--valid-data", "wiki.txt", "--micro-batch-size", "1"],
     "WIKITEXT103 evaluation"),
    ("tasks/eval_harness/evaluate.py", ["--task_list", "lambada_openai"], "evaluation"),
])
def test_inference_without_load_needs_the_opt_in(tiny_data: dict, tmp_path: Path, tool: str, extra: list,
                                                 what: str) -> None:
    """No --load at all: the server's one line and its opt-in (--allow-random-weights), not a warning."""
    (tmp_path / "prompts.txt").write_text("Hello\n")
    (tmp_path / "wiki.txt").write_text(" = Title = \n\n Some text for the model to score .\n")
    proc = run(tool, *MODEL, *tiny_data["tokenizer"], *extra, cwd=tmp_path)
    line = assert_one_line_error(proc, f"no --load: {what} would run on random weights", "--allow-random-weights")
    assert proc.stderr.strip().splitlines()[-1] == line


def test_generation_with_the_opt_in_runs_on_random_weights(tiny_data: dict, tmp_path: Path) -> None:
    (tmp_path / "prompts.txt").write_text("Hello\n")
    proc = run("tools/generate_samples_gpt.py", *MODEL, *tiny_data["tokenizer"], "--sample-input-file", "prompts.txt",
               "--out-seq-length", "4", "--greedy", "--allow-random-weights", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNING: no --load given (--allow-random-weights): generation runs on randomly initialised weights" \
        in proc.stdout
    assert (tmp_path / "prompts.txt.out").is_file()
