"""Shared pytest fixtures: paths to ../shared/data and a temporary working directory."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MEGATRON_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared test data not found at {SHARED_DATA} (set MEGATRON_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT
