"""tools/run_text_generation_server.py end to end: serves a tiny model, answers a request, stops cleanly on SIGTERM
(exit 0); a port already in use is one line on stderr (exit 1)."""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys

import pytest

from tests.text_generation.test_server_http import put


def _command(repo_root, shared_data, port: int, extra: tuple = ()) -> list[str]:
    d = shared_data / "openwebtext-1000"
    return [sys.executable, str(repo_root / "tools" / "run_text_generation_server.py"), "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--vocab-file", str(d / "gpt2-tiny-vocab.json"),
            "--merge-file", str(d / "gpt2-tiny-merges.txt"), "--port", str(port), "--max-tokens-to-generate", "8",
            "--allow-random-weights", *extra]


@pytest.mark.parametrize("extra", [(), ("--position-embedding-type", "alibi", "--embed-layernorm")],
                         ids=["gpt", "bloom"])
def test_server_tool_serves_and_stops_on_sigterm(repo_root, shared_data, tmp_path, extra):
    proc = subprocess.Popen(_command(repo_root, shared_data, 0, extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"serving text generation on http://([\d.]+):(\d+)/", line)
            if match:
                address = (match.group(1), int(match.group(2)))
                break
        else:
            raise AssertionError("".join(lines[-20:]))
        status, body = put(address, {"prompts": ["Hello there"], "tokens_to_generate": 4})
        assert status == 200 and body["text"][0].startswith("Hello there")
        status, body = put(address, {"prompts": ["Hello there"], "tokens_to_generate": 9})
        assert status == 400 and "--max-tokens-to-generate" in body["message"]
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, rest
        assert "server stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_server_tool_port_in_use_is_one_line(repo_root, shared_data, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run(_command(repo_root, shared_data, port), capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use); pick another --port or --host"]
