"""Shell scripts started by the tests run this interpreter as `python` (issue 29 item 0): in a venv made as the README
says, in a conda env and in a bare interpreter alike, `python` and `python3` found through the PATH the tests give to
scripts are this environment (same prefix, same site-packages), and a symlink-to-venv in an unrelated folder is not
used anywhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.interpreter import path_with_this_python

PROBE = "import json, sys, torch; print(json.dumps([sys.prefix, sys.executable, torch.__file__]))"


def test_python_on_the_scripts_path_is_this_environment() -> None:
    import torch

    env = {**os.environ, "PATH": path_with_this_python()}
    for name in ("python", "python3"):
        out = subprocess.run(["bash", "-c", f'{name} -c "$0"', PROBE], env=env, capture_output=True, text=True,
                             check=True, timeout=120).stdout
        prefix, _, torch_file = json.loads(out)
        assert prefix == sys.prefix and Path(torch_file).resolve() == Path(torch.__file__).resolve()


def test_no_test_points_a_python_symlink_at_the_interpreter() -> None:
    tests = Path(__file__).resolve().parent
    offenders = [str(p.relative_to(tests)) for p in tests.rglob("*.py")
                 if p.name != "test_interpreter.py" and "symlink_to(sys.executable" in p.read_text(encoding="utf-8")]
    assert offenders == []
