"""The quick lane: mark every test that starts processes `slow`, found from its code, and catch the ones that slip.

`auto_mark_slow(items)` (called at collection by tests/conftest.py) reads each test function, its fixtures and the
test helpers they call (anything defined under `tests/`), transitively, and marks the test `slow` when that code
refers to a process launcher: `subprocess`, `multiprocessing` / `torch.multiprocessing` (mp.spawn, Process, pools),
`os.system`/`os.fork`/`os.exec*`/`os.posix_spawn`, `ProcessPoolExecutor`, or the test launch helpers that use them
(run_distributed, torchrun and entry-script runners, the megatron-core oracle, DeepSpeed launches). New tests written
with those helpers are marked without anyone thinking of it; an explicit `@pytest.mark.slow` still works.

`ProcessGuard` backs that reading up at run time: a test that is not marked `slow` and still starts a process (through
library code the reading does not follow) fails with one line naming the command, so the quick lane
(`pytest -m "not slow"`) never quietly grows process launches.
"""
from __future__ import annotations

import importlib
import inspect
import multiprocessing.process
import os
import subprocess
import sys
import types
from typing import Any, Iterable

import pytest

_PROCESS_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures.process", "pty"}
_OS_LAUNCHERS = {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnl",
                 "execv", "execve", "execvp", "execvpe", "execl", "execlp"}
_LAUNCHER_NAMES = {"ProcessPoolExecutor", "Popen", "spawn", "start_processes", "check_output", "check_call"}
# Commands libraries run for themselves (a build of the dataset helpers on first use, platform.processor()'s `uname`,
# lm-eval's `git describe`, ctypes' `ldconfig`): not a launch of the code under test, and which test triggers them
# first depends on the order, so the guard lets them pass.
_TOLERATED = {"c++", "g++", "gcc", "cc", "clang", "clang++", "make", "ninja", "uname", "ldconfig", "git", "lscpu",
              "getconf", "nvidia-smi"}


def _is_test_code(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
    return isinstance(module, str) and (module == "tests" or module.startswith("tests.")
                                        or module.startswith("conftest"))


def _is_process_module(obj: Any) -> bool:
    return isinstance(obj, types.ModuleType) and (
        obj.__name__ in _PROCESS_MODULES or obj.__name__.startswith("multiprocessing."))


class _Reader:
    """Transitive reading of test code for references to process launchers (memoised per code object)."""

    def __init__(self) -> None:
        self._memo: dict[int, bool] = {}

    def function(self, fn: Any) -> bool:
        fn = inspect.unwrap(fn) if callable(fn) else fn
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        if isinstance(fn, type):
            return any(self.function(v) for v in vars(fn).values() if inspect.isfunction(v)
                       or isinstance(v, (staticmethod, classmethod)))
        code = getattr(fn, "__code__", None)
        if code is None:
            return False
        key = id(code)
        if key not in self._memo:
            self._memo[key] = False  # cycles (recursive helpers) read as "no launch" until proven otherwise
            self._memo[key] = self._code(code, getattr(fn, "__globals__", {}))
        return self._memo[key]

    def _code(self, code: types.CodeType, globs: dict) -> bool:
        names = set(code.co_names)
        if names & _PROCESS_MODULES or any(n.startswith("multiprocessing.") for n in names):
            return True  # `import subprocess` / `import torch.multiprocessing as mp` inside a function
        for name in names:
            if name.startswith("tests."):  # `from tests.x import helper` inside a function
                try:
                    module = importlib.import_module(name)
                except ImportError:
                    continue
                if any(self.function(getattr(module, other)) for other in names if hasattr(module, other)
                       and (inspect.isfunction(getattr(module, other)) or inspect.isclass(getattr(module, other)))
                       and _is_test_code(getattr(module, other))):
                    return True
            if name not in globs:
                continue
            obj = globs[name]
            if _is_process_module(obj):
                return True
            if obj is sys.modules.get("os") and names & _OS_LAUNCHERS:
                return True
            if getattr(obj, "__name__", None) in _LAUNCHER_NAMES and not _is_test_code(obj):
                return True
            if isinstance(obj, types.ModuleType) and _is_test_code(obj):
                # `helpers.run(...)`: the attribute names are in co_names too
                if any(self.function(getattr(obj, other)) for other in names if hasattr(obj, other)
                       and (inspect.isfunction(getattr(obj, other)) or inspect.isclass(getattr(obj, other)))
                       and _is_test_code(getattr(obj, other))):
                    return True
            elif (inspect.isfunction(obj) or inspect.isclass(obj)) and _is_test_code(obj):
                if self.function(obj):
                    return True
            elif callable(obj) and _is_test_code(getattr(obj, "func", None)):  # functools.partial of a helper
                if self.function(obj.func):
                    return True
        return any(self._code(const, globs) for const in code.co_consts if isinstance(const, types.CodeType))


def _fixture_functions(item: pytest.Item) -> Iterable[Any]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    funcs = []
    for defs in info.name2fixturedefs.values():
        for fixturedef in defs:
            funcs.append(fixturedef.func)
    return funcs


def starts_processes(item: pytest.Item, reader: _Reader | None = None) -> bool:
    reader = reader or _Reader()
    fn = getattr(item, "function", None)
    if fn is not None and reader.function(fn):
        return True
    return any(reader.function(f) for f in _fixture_functions(item))


def auto_mark_slow(items: list[pytest.Item]) -> int:
    """Mark `slow` every collected test whose code (or fixtures, or test helpers) starts processes; return how many."""
    reader = _Reader()
    marked = 0
    for item in items:
        if item.get_closest_marker("slow") is None and starts_processes(item, reader):
            item.add_marker(pytest.mark.slow)
            marked += 1
    return marked


class ProcessGuard:
    """Records process starts while a test that is not marked `slow` runs; the test then fails naming them."""

    def __init__(self) -> None:
        self.active = False
        self.started: list[str] = []
        self._popen_init = subprocess.Popen.__init__
        self._process_start = multiprocessing.process.BaseProcess.start

    def install(self) -> None:
        guard = self

        def popen_init(popen_self, args, *a, **kw):  # type: ignore[no-untyped-def]
            argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
            if guard.active and argv and os.path.basename(argv[0]) not in _TOLERATED:
                guard.started.append(" ".join(argv)[:200])
            return guard._popen_init(popen_self, args, *a, **kw)

        def process_start(process_self):  # type: ignore[no-untyped-def]
            if guard.active:
                guard.started.append(f"multiprocessing {process_self.name}")
            return guard._process_start(process_self)

        subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = process_start  # type: ignore[method-assign]

    def uninstall(self) -> None:
        subprocess.Popen.__init__ = self._popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = self._process_start  # type: ignore[method-assign]

    def begin(self, item: pytest.Item) -> None:
        self.started = []
        self.active = item.get_closest_marker("slow") is None

    def end(self) -> list[str]:
        self.active = False
        started, self.started = self.started, []
        return started
