"""The house rules that an AST scan can check: no private name imported from another module (megatron/, tools/,
tasks/ and the scripts at the top), and no function over 80 lines under megatron/ except the marked ports of
Megatron's own algorithms."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("megatron", "tools", "tasks")


def _files() -> List[Path]:
    """Every .py file of the scanned folders plus the scripts at the top (pretrain_*.py, setup.py)."""
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py")) + sorted(ROOT.glob("*.py"))


def private_imports(source: str) -> List[str]:
    """`module:name` for each `from module import _name` in `source` (dunder names are not private)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [f"{'.' * node.level}{node.module or ''}:{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_the_scan_finds_a_private_import() -> None:
    src = "from a.b import _x, y, __version__\ndef f():\n    from .c import _z\n"
    assert private_imports(src) == ["a.b:_x", ".c:_z"]


def test_no_private_name_is_imported_across_modules() -> None:
    found = [f"{p.relative_to(ROOT)}: {hit}" for p in _files() for hit in private_imports(p.read_text(encoding="utf-8"))]
    assert found == []
