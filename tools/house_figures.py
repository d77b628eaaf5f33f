"""The house's coupling figures (issue 36), measured by a static scan of a checkout (no imports, so any commit measures
the same way), and the cost of a family from git.

Figures for megatron/ (``python tools/house_figures.py [ROOT]``):

* lines of Python, function-level imports (total, per 1,000 lines, how many name an in-tree module);
* private names imported across modules (``from m import _x``), functions over 80 lines (and how many are marked
  "port of Megatron's <name>"), module-level ``__getattr__``;
* format code that branches on a family (``model_type`` compared with a name or a literal list of names under
  megatron/checkpoint/);
* layering: modules under megatron/checkpoint/ that import the flag layer (megatron.arguments, megatron.global_vars,
  megatron.initialize); modules of one family (megatron/models/<a>/) that import another's (megatron.models.<b>);
* attribute writes on ``args`` (``args.x = ...``, ``setattr(args, ...)``) per file.

``--family-cost REV_A..REV_B --folder megatron/models/<family>`` counts the library files (megatron/ and the entry
scripts at the top) a range of commits touched outside the family's folder: the figure docs/architecture.md's
"Adding a family" is measured by.
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

FLAG_LAYER = ("megatron.arguments", "megatron.global_vars", "megatron.initialize")
FAMILY_NAMES = ("GPT", "BERT", "T5")
# Modules directly under megatron/models/ that every family may import (not a family of their own).
SHARED_MODEL_MODULES = ("registry", "hf_common", "hf_adapter", "family_specs")

# The scanners below are the one implementation of each house rule's scan: this tool's figures and the house test
# (tests/test_house_rules.py) both call them, so the figure a document quotes and the rule a test enforces count the
# same things.


def _modules(root: Path) -> Iterator[Tuple[str, ast.Module, str]]:
    for path in sorted((root / "megatron").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        yield path.relative_to(root).as_posix(), ast.parse(text), text


def package_of(rel: str) -> str:
    """The package a file belongs to: megatron/data/helpers.py -> megatron.data."""
    return ".".join(rel[:-len(".py")].split("/")[:-1]) if rel.endswith(".py") else rel


def imported_by(node: ast.AST, package: str) -> List[str]:
    """The absolute module names one import statement names: `import a.b` -> a.b; `from m import x, y` -> m, m.x,
    m.y (relative ones resolved against `package`, the importing module's package)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        return [base] + [f"{base}.{a.name}" for a in node.names]
    return []


def imported_modules(source: str, package: str) -> List[str]:
    """Every module `source` imports (function-level and relative imports included; `package`: its own package)."""
    return [name for node in ast.walk(ast.parse(source)) for name in imported_by(node, package)]


def function_level_imports(source: str, path: str) -> List[Tuple[str, int]]:
    """(module, line) for each import statement inside a function of `source` (each counted once, however deep;
    relative imports resolved against `path`, e.g. megatron/data/helpers.py)."""
    found: Dict[int, Tuple[str, int]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    found[id(sub)] = (imported_by(sub, package_of(path))[0], sub.lineno)
    return sorted(found.values(), key=lambda hit: hit[1])


def private_imports(source: str) -> List[str]:
    """`module:name` for each `from module import _name` in `source` (dunder names are not private)."""
    return [f"{'.' * node.level}{node.module or ''}:{a.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")]


def long_functions(source: str, limit: int = 80) -> Dict[str, bool]:
    """name -> whether it is marked as a port ("# port of Megatron's <name>"), for each function of `source` longer
    than `limit` lines."""
    lines = source.splitlines()
    return {node.name: any("# port of Megatron's " in line for line in lines[node.lineno - 1:node.end_lineno])
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit}


def family_leaks(source: str, package: str) -> List[str]:
    """The other families' modules imported by `source`, a module of `package` (megatron.models.<family>[...])."""
    family = package.split(".")[2]
    return sorted(m for m in imported_modules(source, package)
                  if m.startswith("megatron.models.") and len(m.split(".")) > 2
                  and m.split(".")[2] not in (family, *SHARED_MODEL_MODULES))


def _literal_names(node: ast.AST, names: Tuple[str, ...] = ()) -> bool:
    """A string constant (one of `names` when given), or a literal tuple/list/set holding one."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_literal_names(e, names) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and (not names or node.value in names)


def model_type_branches(source: str) -> List[str]:
    """Each comparison (`==`, `!=`, `in`, `not in`) in `source` that branches on a model family, as `line: text`:
    `model_type` compared with a string literal (or a literal list of them), or anything compared with "GPT", "BERT"
    or "T5". A comparison with a named table (the converter's supported types) or an enum is not a family branch."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare) or not any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                        for op in node.ops):
            continue
        left = node.left
        name = left.attr if isinstance(left, ast.Attribute) else getattr(left, "id", "")
        if (name == "model_type" and any(_literal_names(c) for c in node.comparators)) or any(
                _literal_names(n, FAMILY_NAMES) for n in (node.left, *node.comparators)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _args_writes(tree: ast.Module) -> int:
    count = 0
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        count += sum(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "args"
                     for t in targets)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and \
                node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "args":
            count += 1
    return count


def figures(root: Path) -> dict:
    """Every figure of the module docstring for the checkout at `root`."""
    lines = fl_total = fl_in_tree = long_fns = ports = 0
    private, getattrs, branches, flag_layer, cross, args_writes = [], [], [], [], [], {}
    for rel, tree, text in _modules(root):
        lines += len(text.splitlines())
        inner = function_level_imports(text, rel)
        fl_total += len(inner)
        fl_in_tree += sum(module.split(".")[0] == "megatron" for module, _ in inner)
        private += [f"{rel}: {hit}" for hit in private_imports(text)]
        marks = long_functions(text)
        long_fns, ports = long_fns + len(marks), ports + sum(marks.values())
        if rel.startswith("megatron/checkpoint/"):
            branches += [f"{rel}:{hit.split(':')[0]}" for hit in model_type_branches(text)]
        own = rel.split("/")[2] if len(rel.split("/")) > 3 and rel.split("/")[1] == "models" else ""
        for node in ast.walk(tree):
            names = imported_by(node, package_of(rel))
            if rel.startswith("megatron/checkpoint/") and any(n in FLAG_LAYER or n.startswith(
                    tuple(f"{m}." for m in FLAG_LAYER)) for n in names):
                flag_layer.append(f"{rel}:{node.lineno}")
            others = {n.split(".")[2] for n in names if n.startswith("megatron.models.") and len(n.split(".")) > 3
                      and (root / "megatron" / "models" / n.split(".")[2]).is_dir()}
            if own and others - {own}:
                cross.append(f"{rel}:{node.lineno} -> {', '.join(sorted(others - {own}))}")
        getattrs += [rel for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
        writes = _args_writes(tree)
        if writes:
            args_writes[rel] = writes
    return {
        "lines": lines,
        "function_level_imports": fl_total,
        "function_level_imports_per_1000_lines": round(1000 * fl_total / max(lines, 1), 2),
        "function_level_imports_in_tree": fl_in_tree,
        "private_imports_across_modules": private,
        "functions_over_80_lines": long_fns,
        "of_which_marked_ports": ports,
        "module_getattr": getattrs,
        "model_type_branches_in_checkpoint_code": branches,
        "checkpoint_imports_of_the_flag_layer": flag_layer,
        "family_imports_of_another_family": cross,
        "args_writes_per_file": args_writes,
    }


def family_cost(root: Path, revs: str, folder: str) -> List[str]:
    """Library files (megatron/**.py, the top-level scripts) that the commits in `revs` changed outside `folder`."""
    out = subprocess.run(["git", "-C", str(root), "diff", "--name-only", revs], check=True, capture_output=True,
                         text=True).stdout.split()
    folder = folder.rstrip("/") + "/"
    return sorted(p for p in out if p.endswith(".py") and (p.startswith("megatron/") or "/" not in p)
                  and not p.startswith(folder))


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--family-cost", metavar="REV_A..REV_B")
    parser.add_argument("--folder", help="the family's folder, e.g. megatron/models/deepseek (with --family-cost)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.family_cost:
        if not args.folder:
            parser.error("--family-cost needs --folder (the family's folder)")
        files = family_cost(root, args.family_cost, args.folder)
        print(f"{len(files)} library files outside {args.folder}:")
        print("\n".join(f"  {f}" for f in files))
        return 0
    fig = figures(root)
    if args.json:
        print(json.dumps(fig, indent=1))
        return 0
    for key, value in fig.items():
        if isinstance(value, (list, dict)):
            print(f"{key}: {len(value)}")
            for item in (value.items() if isinstance(value, dict) else value):
                print(f"    {item[0]}: {item[1]}" if isinstance(value, dict) else f"    {item}")
        else:
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
