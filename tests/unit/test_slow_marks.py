"""The quick lane's marking (tests/_slow_marks.py): a test that starts processes, directly, through a test helper
(also one imported inside a function) or through a fixture, is read as `slow`; a pure test is not; and the run-time
guard fails an unmarked test that starts a process anyway."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests._slow_marks import _Reader
from tests.dist_utils import run_distributed


def _direct() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _through_helper() -> None:
    run_distributed(print, world_size=2)


def _through_local_import() -> None:
    from tests.training._llama import serial_curve

    serial_curve({})


def _through_a_helper_of_a_helper() -> None:
    _through_helper()


def _pure() -> int:
    return sum(range(10))


SAMPLES = {"_direct": True, "_through_helper": True, "_through_local_import": True,
           "_through_a_helper_of_a_helper": True, "_pure": False}  # by name, so this test refers to none of them


def test_reader_finds_every_way_of_starting_processes(request: pytest.FixtureRequest) -> None:
    reader = _Reader()
    for name, launches in SAMPLES.items():
        assert reader.function(getattr(sys.modules[__name__], name)) is launches, name
    assert request.node.get_closest_marker("slow") is None  # this test starts nothing: it stays in the quick lane


@pytest.mark.slow  # it starts pytest's inner test, which starts a process
def test_guard_fails_an_unmarked_test_that_starts_a_process(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(textwrap.dedent("""
        import pytest
        from tests._slow_marks import ProcessGuard

        GUARD = ProcessGuard()

        def pytest_configure(config):
            GUARD.install()

        def pytest_unconfigure(config):
            GUARD.uninstall()

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_call(item):
            GUARD.begin(item)
            result = yield
            started = GUARD.end()
            if started:
                pytest.fail("started " + started[0], pytrace=False)
            return result
    """))
    pytester.makepyfile(textwrap.dedent("""
        import subprocess, sys, pytest

        def test_unmarked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        @pytest.mark.slow
        def test_marked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_pure():
            assert 1 + 1 == 2
    """))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked*", "started *-c pass"])
