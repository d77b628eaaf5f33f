"""The interpreter running the tests, for shell scripts that call `python` (examples/*.sh, the SLURM scripts).

`path_with_this_python(path)` returns a PATH whose first folder holds `python` and `python3` wrapper scripts that
`exec` this interpreter by its own path (`sys.executable`), followed by the folder of `sys.executable` (torchrun,
deepspeed, pip of the same environment). A wrapper, never a symlink: a symlink to a venv's `bin/python` placed in
another folder starts the base interpreter (Python finds `pyvenv.cfg` beside the path it was started from), and in a
bare install the interpreter's folder may hold only `python3.X`. Works the same in a venv, a conda env and a bare
interpreter.
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path


def python_wrapper_dir() -> Path:
    """A folder with `python`/`python3` scripts that run `sys.executable` (made once per interpreter, atomically)."""
    tag = hashlib.sha256(sys.executable.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"megatron-tests-python-{os.getuid()}-{tag}"
    folder.mkdir(mode=0o755, exist_ok=True)
    script = f'#!/bin/sh\nexec "{sys.executable}" "$@"\n'
    for name in ("python", "python3"):
        target = folder / name
        if not target.is_file() or target.read_text() != script:
            tmp = folder / f".{name}.{os.getpid()}"
            tmp.write_text(script)
            tmp.chmod(0o755)
            os.replace(tmp, target)
    return folder


def path_with_this_python(path: str | None = None) -> str:
    """PATH (default: this process's) with this interpreter first as `python`, then its own folder."""
    rest = os.environ.get("PATH", "") if path is None else path
    return os.pathsep.join([str(python_wrapper_dir()), os.path.dirname(sys.executable), rest])
