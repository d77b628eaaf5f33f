"""Shared helpers for the reliability tests: a tiny corpus, the tiny GPT's flags, and running entry points the way a
user does (a subprocess; exit code and the one `error:` line are what the tests check)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from megatron.presets import get_preset

REPO = Path(__file__).resolve().parents[2]
MODEL = get_preset("gpt_micro_test").argv()  # 2 layers, hidden 32, 4 heads, seq 32


def build_corpus(shared_data: Path, out_dir: Path, num_docs: int = 30) -> dict:
    """Tokenise the first `num_docs` openwebtext documents into an mmap .bin/.idx pair; returns paths and flags."""
    from megatron.data.indexed_dataset import index_file_path, make_builder
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

    owt = shared_data / "openwebtext-1000"
    vocab, merges = str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt")
    tok = GPT2BPETokenizer(vocab, merges)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = str(out_dir / "owt_text_document")
    builder = make_builder(prefix + ".bin", impl="mmap", vocab_size=tok.vocab_size)
    with open(owt / "openwebtext-1000.jsonl") as f:
        for _, line in zip(range(num_docs), f):
            builder.add_item(np.asarray(tok.tokenize(json.loads(line)["text"]) + [tok.eod], dtype=np.int64))
            builder.end_document()
    builder.finalize(index_file_path(prefix))
    return {"prefix": prefix, "vocab": vocab, "merges": merges, "dir": out_dir,
            "tokenizer": ["--vocab-file", vocab, "--merge-file", merges]}


def train_argv(data: dict, *extra: str, iters: int = 2) -> list[str]:
    """pretrain_gpt.py flags of the tiny GPT (fp32, no dropout, log every iteration, no evaluation)."""
    return [*MODEL, *data["tokenizer"], "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", str(iters), "--lr", "1e-3", "--data-path", data["prefix"], "--split", "100,0,0",
            "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", *extra]


def run(script: str, *argv: str, cwd: Path, env: Optional[dict] = None, timeout: int = 300
        ) -> subprocess.CompletedProcess:
    """Run REPO/script as a user would (fresh interpreter, one thread)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGATRON_TRUST_CHECKPOINT"):
        if not env or key not in env:
            full_env.pop(key, None)
    return subprocess.run([sys.executable, str(REPO / script), *argv], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def assert_one_line_error(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit code 1, no traceback, exactly one `error:` line containing every `expected` fragment."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = error_lines(proc)
    assert len(errors) == 1, proc.stderr[-3000:]
    for fragment in expected:
        assert fragment in errors[0], errors[0]
    return errors[0]


def run_ranks(argv: list[str], out: Path, world: int = 2, timeout: int = 300, **env_extra: str) -> list[dict]:
    """`world` ranks of tests/reliability/_rank_worker.py started as srun starts them (RANK/WORLD_SIZE/MASTER_* in
    the environment; `env_extra`, e.g. REL_FAULT or REL_SLOW); all must exit 0; returns each rank's pretrain()
    result. Logs in OUT/rank<R>.out/.err."""
    from megatron.initialize import find_free_port

    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "REL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()),
               WORLD_SIZE=str(world), **env_extra)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.reliability._rank_worker", str(out), *argv], cwd=out,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=open(out / f"rank{r}.out", "w"),
                              stderr=open(out / f"rank{r}.err", "w")) for r in range(world)]
    try:
        for r, proc in enumerate(procs):
            assert proc.wait(timeout=timeout) == 0, (out / f"rank{r}.err").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [json.loads((out / f"rank{r}.attempt0.json").read_text()) for r in range(world)]
