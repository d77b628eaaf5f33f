"""Normal runs are quiet on a terminal (issue 29 item 8): on a terminal (a pseudo-terminal here) pretrain_gpt.py
prints one `> arguments:` summary line instead of Megatron's ~200-line dump;
--log-args brings the dump back, and a redirected log keeps it. The eval harness's progress in a redirected log is
whole lines, no '\\r'."""
from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.presets import get_preset

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures" / "gpt2-bpe"
ARGV = [*get_preset("gpt_micro_test").argv(), "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(FIX / "gpt2-vocab.json"), "--merge-file",
        str(FIX / "gpt2-merges.txt"), "--data-path", "/nonexistent/prefix"]  # stops after start-up, one line


def _on_a_terminal(*extra: str) -> str:
    """Run pretrain_gpt.py with stdout and stderr on a pseudo-terminal; return what the terminal showed."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(REPO / "pretrain_gpt.py"), *ARGV, *extra], stdout=slave,
                            stderr=slave, stdin=subprocess.DEVNULL, env=env, cwd=REPO)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=300) == 1
    return b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


@pytest.mark.slow
def test_argument_dump_is_one_line_on_a_terminal_and_full_with_log_args() -> None:
    screen = _on_a_terminal()
    summary = [line for line in screen.splitlines() if line.startswith("> arguments: ")]
    assert len(summary) == 1 and "layers 2, hidden 32, heads 4, seq 32" in summary[0], screen
    assert "--log-args prints them all" in summary[0]
    assert "------------------------ arguments" not in screen and "overriding default arguments" not in screen
    assert "error: --data-path /nonexistent/prefix: no such dataset" in screen
    full = _on_a_terminal("--log-args")
    assert "------------------------ arguments ------------------------" in full and "> arguments: " not in full


def test_eval_harness_progress_is_whole_lines_in_a_log(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    from tasks.eval_harness import adapter

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = adapter._LineProgress(10, "loglikelihood requests", every=0.0)
    for _ in range(10):
        bar.update(1)
    bar.close()
    lines = err.getvalue().splitlines()
    assert "\r" not in err.getvalue() and lines[0] == "loglikelihood requests: 1/10"
    assert lines[-1] == "loglikelihood requests: 10/10 done" and len(lines) == 11
