"""Shared pytest fixtures (the shipped test data in tests/fixtures/, the optional full data set, the repo root) and the
quick lane: tests that start processes are marked `slow` automatically (tests/_slow_marks.py). At start-up the
repository's own packages are byte-compiled once (see `compile_repository`)."""
from __future__ import annotations

import compileall
from pathlib import Path

import pytest

from tests import fixtures as fixture_set
from tests._slow_marks import ProcessGuard, auto_mark_slow

pytest_plugins = ["pytester"]  # tests/unit/test_slow_marks.py runs an inner pytest

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


_GUARD = ProcessGuard()
COMPILED = ("megatron", "tasks", "tools", "tests")  # the packages the suite's processes import (scripts run as __main__)


def compile_repository(root: Path = REPO_ROOT) -> None:
    """Write the `__pycache__` bytecode of the repository's packages (only what is missing or stale; in-process).
    Where PYTHONDONTWRITEBYTECODE is set (as in this machine's shells), Python never writes it, so each of the suite's
    hundreds of processes would compile every module it imports from source (~0.3-0.5 CPU s for megatron.training);
    Python still reads bytecode that exists, and a changed source makes its bytecode stale (compiled afresh)."""
    for name in COMPILED:
        compileall.compile_dir(root / name, quiet=1, workers=1)


def pytest_configure(config: pytest.Config) -> None:
    compile_repository()
    _GUARD.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    _GUARD.uninstall()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that starts processes is `slow` (read from its code; tests/_slow_marks.py): the quick lane is
    `pytest -m "not slow"`."""
    auto_mark_slow(items)


def _refuse_unmarked_launches(item: pytest.Item, phase: str) -> None:
    started = _GUARD.end()
    if started:
        pytest.fail(f"{item.nodeid} started {len(started)} process(es) in {phase} ({started[0]}) but is not marked "
                    "slow: add @pytest.mark.slow (the quick lane `pytest -m 'not slow'` runs no processes)",
                    pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    _GUARD.begin(item)
    result = yield
    _refuse_unmarked_launches(item, "setup")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    _GUARD.begin(item)
    result = yield
    _refuse_unmarked_launches(item, "the test")
    return result
