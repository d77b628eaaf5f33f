"""tools/preprocess_data.py on hostile input and interruptions: an empty input is one `error:` line (a counted
warning with --allow-empty); an unwritable output folder is one line; SIGTERM stops it cleanly (exit 143, no temp files,
no worker tracebacks) and the temp files a SIGKILL leaves are removed by the next run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.helpers import REPO, run

TOOL = "tools/preprocess_data.py"


def _tok(shared_data: Path) -> list[str]:
    owt = shared_data / "openwebtext-1000"
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(owt / "gpt2-tiny-vocab.json"),
            "--merge-file", str(owt / "gpt2-tiny-merges.txt")]


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".part" in p.name)


@pytest.mark.parametrize("content", ["", "\n\n", json.dumps({"text": ""}) + "\n"])
def test_empty_input_is_one_line(shared_data: Path, tmp_path: Path, content: str) -> None:
    (tmp_path / "in.jsonl").write_text(content)
    proc = run(TOOL, "--input", "in.jsonl", "--output-prefix", "out", *_tok(shared_data), cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "none with tokens" in errors[0] and "--allow-empty" in errors[0], proc.stderr
    assert not list(tmp_path.glob("out*"))  # nothing published
    proc = run(TOOL, "--input", "in.jsonl", "--output-prefix", "out", *_tok(shared_data), "--allow-empty",
               cwd=tmp_path)
    assert proc.returncode == 0 and "warning: --input in.jsonl:" in proc.stderr and "(--allow-empty)" in proc.stderr
    assert (tmp_path / "out_text_document.idx").is_file()


def test_unwritable_output_is_one_line(shared_data: Path, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    if os.geteuid() == 0:  # root ignores permission bits: use a folder no one can write to
        target = "/sys/out"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        target = str(ro / "out")
    proc = run(TOOL, "--input", "in.jsonl", "--output-prefix", target, *_tok(shared_data), cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--output-prefix" in errors[0] and ("not writable" in errors[0]
                                                                    or "cannot write" in errors[0]), proc.stderr


def _start(shared_data: Path, tmp_path: Path, extra: list[str]) -> subprocess.Popen:
    src = (shared_data / "openwebtext-1000" / "openwebtext-1000.jsonl").read_text()
    big = tmp_path / "big.jsonl"
    if not big.exists():
        big.write_text(src * 6)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(REPO / TOOL), "--input", str(big), "--output-prefix", "out",
                             *_tok(shared_data), "--workers", "2", "--log-interval", "50", "--chunk-size", "4",
                             *extra], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)


def _wait_for_progress(proc: subprocess.Popen) -> list[str]:
    lines = []
    for line in proc.stderr:  # the tool is writing .tmp files once it reports processed documents
        lines.append(line)
        if line.startswith("Processed "):
            return lines
    raise AssertionError("".join(lines))


def test_sigterm_and_sigkill_leave_no_temp_files(shared_data: Path, tmp_path: Path) -> None:
    proc = _start(shared_data, tmp_path, [])
    _wait_for_progress(proc)
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, rest
    assert "Traceback" not in rest and "interrupted: no output was published" in rest, rest
    assert _temps(tmp_path) == [] and not list(tmp_path.glob("out*"))

    proc = _start(shared_data, tmp_path, [])
    _wait_for_progress(proc)
    proc.kill()
    proc.communicate(timeout=60)
    left = _temps(tmp_path)
    assert left, "a SIGKILL mid-run leaves its temporary files"
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "hello world"}) + "\n")
    again = run(TOOL, "--input", str(small), "--output-prefix", "out", *_tok(shared_data), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"removed {len(left)} temporary file(s) of an interrupted earlier run" in again.stderr
    assert _temps(tmp_path) == []
