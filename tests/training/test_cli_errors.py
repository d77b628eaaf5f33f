"""pretrain_gpt.py turns bad flags and missing files into one `error:` line and exit code 1, not a traceback."""
import subprocess
import sys

import pytest

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3"]


def _run(repo_root, shared_data, tmp_path, extra):
    tok = shared_data / "openwebtext-1000"
    cmd = [sys.executable, str(repo_root / "pretrain_gpt.py"), *MODEL, "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", str(tok / "gpt2-tiny-vocab.json"), "--merge-file", str(tok / "gpt2-tiny-merges.txt"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("extra, expected", [
    (["--tensor-model-parallel-size", "2", "--data-path", "x"], "--tensor-model-parallel-size (2)"),
    (["--data-path", "does/not/exist_text_document"], "check --data-path"),
])
def test_user_errors_are_one_line(repo_root, shared_data, tmp_path, extra, expected):
    proc = _run(repo_root, shared_data, tmp_path, extra)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
