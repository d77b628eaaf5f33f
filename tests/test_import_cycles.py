"""Imports point down, lazy ones included: an AST scan of the whole tree (megatron/, tools/, tasks/ and the entry
scripts at the top; module-level and function-level imports) finds no import cycle."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron"
SCANNED = ("megatron", "tools", "tasks")  # plus the *.py files at the top (pretrain_*.py, setup.py)


def _modules() -> Dict[str, Path]:
    """Dotted module name -> file, for every .py file of the scanned folders and the top-level scripts."""
    paths = [p for top in SCANNED for p in (ROOT / top).rglob("*.py")] + sorted(ROOT.glob("*.py"))
    mods = {}
    for path in paths:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph() -> Dict[str, Set[str]]:
    """module -> the modules of this tree it imports anywhere in its body (TYPE_CHECKING blocks excluded)."""
    mods = _modules()

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []  # annotations only, never imported at run time
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                resolved = resolve(target)
                if resolved:
                    if resolved != mod:
                        graph[mod].add(resolved)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[Set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[Set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_three_start_up_cycles_are_gone() -> None:
    graph = import_graph()
    assert "megatron.arguments" not in graph["megatron.ds.config"]
    assert "megatron.initialize" not in graph["megatron.arguments"]
    assert "megatron.training" not in graph["megatron.ds.engine"]
    assert not graph["megatron.launcher"] & {"megatron.arguments", "megatron.initialize"}
    assert "megatron.training" not in graph["megatron.model_setup"]


def test_no_import_cycles_anywhere() -> None:
    graph = import_graph()
    assert {"megatron.training", "pretrain_gpt", "tools.preprocess_data", "tasks.main",
            "megatron.data.indexed_dataset"} <= set(graph)  # the whole tree is scanned
    found = [sorted(c) for c in cycles(graph)]
    assert not found, f"import cycles (lazy imports included): {found}; move the shared code into a module below both"


def test_the_two_data_cycles_are_gone() -> None:
    graph = import_graph()
    assert "megatron.data.indexed_dataset" not in graph["megatron.data.legacy_indexed_dataset"]
    assert "megatron.data.dataset_utils" not in graph["megatron.data.helpers"]


def test_the_scan_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
