"""tests/conftest.py byte-compiles the repository's packages at pytest start-up, so that the suite's processes read
bytecode instead of compiling each module they import (where PYTHONDONTWRITEBYTECODE is set)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tests.conftest import COMPILED, REPO_ROOT, compile_repository


def test_bytecode_is_written_for_each_package_and_refreshed_when_stale(tmp_path: Path) -> None:
    sources = []
    for name in COMPILED:
        (tmp_path / name / "sub").mkdir(parents=True)
        sources += [tmp_path / name / "__init__.py", tmp_path / name / "sub" / "mod.py"]
    for i, source in enumerate(sources):
        source.write_text(f"X = {i}\n")
    compile_repository(tmp_path)
    cached = [Path(importlib.util.cache_from_source(str(s))) for s in sources]
    assert all(c.is_file() for c in cached)
    before = cached[1].read_bytes()
    sources[1].write_text("X = 'changed source'\n")
    later = sources[1].stat().st_mtime + 10  # compileall compares whole seconds of mtime (the importer, size too)
    os.utime(sources[1], (later, later))
    compile_repository(tmp_path)
    assert cached[1].read_bytes() != before and b"changed source" in cached[1].read_bytes()


def test_the_suite_compiled_this_repository() -> None:
    module = REPO_ROOT / "megatron" / "training.py"
    assert Path(importlib.util.cache_from_source(str(module))).is_file()
