"""megatron/optional.py: the optional heavy dependencies, imported on first use, one line naming the install when one
is missing."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron import optional


def test_an_installed_package_and_its_submodule_are_returned() -> None:
    assert optional.load("json") is json
    assert optional.load("json", "decoder") is json.decoder


def test_a_missing_package_is_one_line_naming_its_install() -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        optional.load("no_such_package_xyz", "sub")
    assert str(info.value) == ("no_such_package_xyz.sub is needed here but no_such_package_xyz is not installed "
                               "(pip install no_such_package_xyz)")
    assert info.value.name == "no_such_package_xyz"


def test_a_known_package_names_its_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(optional.INSTALL, "no_such_package_xyz", "pip install no-such-package")
    with pytest.raises(ImportError, match=r"^no_such_package_xyz is needed here but no_such_package_xyz is not "
                                          r"installed \(pip install no-such-package\)$"):
        optional.load("no_such_package_xyz")


def test_a_missing_submodule_of_an_installed_package_is_not_rewritten() -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        optional.load("json", "no_such_submodule")
    assert info.value.name == "json.no_such_submodule"


def test_the_light_modules_leave_the_heavy_dependencies_unimported(repo_root) -> None:
    """errors/peer_failure (used by the preprocessing tools), the sentence splitter and the DeepSpeed engine module
    reach torch.distributed, nltk and deepspeed through megatron.optional only when they use them."""
    code = ("import sys, megatron.errors, megatron.data.sentence_splitter, megatron.data.helpers; "
            "print(sorted({'torch', 'nltk', 'deepspeed', 'triton'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
