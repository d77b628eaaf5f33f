"""Shared pytest fixtures: the shipped test data (tests/fixtures/), the optional full data set, the repo root."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests import fixtures as fixture_set

REPO_ROOT = fixture_set.REPO_ROOT
SHARED_DATA = fixture_set.FIXTURES  # kept for old imports: the data every test uses ships in the repository


def pytest_report_header(config) -> str:
    full = fixture_set.full_data()
    wide = (f"the full data set at {full} widens a few tests" if full else
            "no full data set (MEGATRON_SHARED_DATA or ../shared/data): widened tests run on the fixtures")
    return f"test data: {fixture_set.FIXTURES} (shipped); {wide}"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shipped fixture set (tests/fixtures/), with the same folder and file names as ../shared/data."""
    return fixture_set.FIXTURES


@pytest.fixture(scope="session")
def wide_data() -> Path:
    """The full data set when present, else the fixtures: for tests that only get wider with more data."""
    return fixture_set.wide_data()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT
