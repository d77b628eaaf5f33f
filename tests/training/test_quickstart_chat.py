"""`bash examples/quickstart.sh chat` from the repository alone: a tiny Hugging Face Qwen2 with a ChatML template
made offline, converted, finetuned with --sft on the shipped chat sample (the loss goes down), served, and asked
through the openai client (plain and streamed replies agree, two 200s in the server's log); SIGTERM then stops the server."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_chat_leg(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path / "qs"), CHAT_TRAIN_ITERS="8", LOG_INTERVAL="1", SKIP_INSTALL="1",
               OMP_NUM_THREADS="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    proc = subprocess.run(["bash", str(REPO / "examples" / "quickstart.sh"), "chat"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"SFT OK: loss ([0-9.]+) -> ([0-9.]+)", proc.stdout)
    assert match and float(match.group(2)) < float(match.group(1))
    assert re.search(r"^assistant: '.*' \(finish_reason (stop|length), \d+ tokens\)$", proc.stdout, flags=re.M)
    assert "chat OK: the openai client's plain and streamed replies agree" in proc.stdout
    out = tmp_path / "qs"
    assert (out / "chat_hf" / "chat_template.jinja").exists() and (out / "chat_sft").is_dir()
    log = (out / "chat_server.log").read_text()
    assert log.count('"POST /v1/chat/completions HTTP/1.1" 200') == 2 and "server stopped" in log
