"""Fixtures for the reliability tests: one tiny corpus and one 2-iteration checkpoint per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.helpers import build_corpus, run, train_argv


@pytest.fixture(scope="session")
def tiny_data(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return build_corpus(shared_data, tmp_path_factory.mktemp("reliability_data"))


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_data: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Megatron checkpoint of the tiny GPT at iteration 2 (written by pretrain_gpt.py --save)."""
    work = tmp_path_factory.mktemp("reliability_ckpt")
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, "--save", str(work / "ckpt"), "--save-interval", "2"),
               cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "ckpt"
