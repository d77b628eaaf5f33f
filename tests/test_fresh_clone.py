"""The README's two commands on a fresh machine (issues 19, 29): clone the repository into an empty temporary folder
(no `../shared` beside it, no MEGATRON_SHARED_DATA), create the virtualenv as the README says (`python -m venv .venv`
in the clone, then `. .venv/bin/activate` before each command), and run the two commands read from the README's first
code block, in short form: the quick-start with TRAIN_ITERS=4 (and short evaluation slices), then the test command on
a subset of the suite chosen for what differs in a virtualenv: the tests that start shell scripts calling `python`
(the SLURM preemption test, `tests/test_interpreter.py`: `python` on a script's PATH is the venv, same sys.prefix)
plus fast fixture and tokenizer tests.

The virtualenv is truly fresh (no --system-site-packages): pip installs everything into it from the locally available
wheels (the machine's pip find-links, which hold the CPU torch wheel as in CI, and pip's cache) and the package
registry. The clone is of the committed HEAD. The whole suite is not run here: `.ci/run` runs it once per CI run, inside a
virtualenv made the same way (`python -m venv .venv`). Slow by nature (a full install): several
minutes on 2 cores.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.interpreter import path_with_this_python

REPO = Path(__file__).resolve().parents[1]
SHORT_QUICKSTART = {"TRAIN_ITERS": "4", "LOG_INTERVAL": "2", "EVAL_INTERVAL": "4", "WIKI_LINES": "10",
                    "LAMBADA_LINES": "10"}  # tests/test_readme_commands.py's short run: the loss still goes down
FAST_SUBSET = ["tests/test_interpreter.py", "tests/reliability/test_preemption.py", "tests/test_fixtures.py",
               "tests/tokenizer/test_tokenizers.py", "-x", "-p", "no:cacheprovider"]
ACTIVATE = ". .venv/bin/activate && "  # the README: python -m venv .venv && . .venv/bin/activate


def readme_commands() -> list[str]:
    """The commands of the README's first ```bash block (comments stripped)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_readme_first_block_is_the_two_commands() -> None:
    assert readme_commands() == ["bash examples/quickstart.sh", "bash tests/run.sh"]
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^bash tests/run\.sh$", ci, flags=re.M)  # CI runs exactly the README's test command
    # ... inside a virtualenv made as the README says, before anything is installed
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "`python -m venv .venv && . .venv/bin/activate`" in readme
    lines = [line.strip() for line in ci.splitlines()]
    assert lines.index("python -m venv .venv") < lines.index(". .venv/bin/activate") < min(
        i for i, line in enumerate(lines) if "pip install" in line) < lines.index("bash tests/run.sh")


@pytest.mark.slow
def test_readme_commands_in_a_fresh_clone_and_virtualenv(tmp_path: Path) -> None:
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.fail("needs a git checkout and git: the test clones the repository")
    quickstart, tests = readme_commands()
    clone = tmp_path / "clone"
    venv = clone / ".venv"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300)
    assert not (tmp_path / "shared").exists()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MEGATRON_SHARED_DATA", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")}
    env.update(PATH=path_with_this_python(env.get("PATH", "")), OMP_NUM_THREADS="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run(["bash", "-c", "python -m venv .venv"], cwd=clone, env=env, check=True, timeout=300)

    def run(command: str, extra_env: dict) -> subprocess.CompletedProcess:
        proc = subprocess.run(["bash", "-c", ACTIVATE + command], cwd=clone, env={**env, **extra_env},
                              capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        return proc

    proc = run(quickstart, SHORT_QUICKSTART)
    out = proc.stdout
    assert "== installing" in out and "Successfully installed" in out  # it set up the empty virtualenv, visibly
    assert re.search(r"training OK: loss [\d.]+ -> [\d.]+", out), out[-3000:]
    assert " validation results on WIKITEXT103 | avg loss:" in out and " validation results on LAMBADA |" in out
    assert "quick-start done" in out

    proc = run(" ".join([tests, *map(shlex.quote, FAST_SUBSET)]), {})
    assert "no full data set" in proc.stdout  # the fixtures alone: nothing beside the clone
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary) and "failed" not in summary and "error" not in summary, summary
    assert (venv / "bin" / "pytest").exists() and (venv / "bin" / "ruff").exists()
