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


def _modules(root: Path) -> Iterator[Tuple[str, ast.Module, str]]:
    for path in sorted((root / "megatron").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        yield path.relative_to(root).as_posix(), ast.parse(text), text


def _imported(node: ast.AST, rel: str) -> List[str]:
    """The absolute module names an import statement names (relative ones resolved against `rel`)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = rel.split("/")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        return [base] + [f"{base}.{a.name}" for a in node.names]
    return []


def function_level_imports(tree: ast.Module) -> List[ast.AST]:
    """Import statements inside a function body (each counted once, however deep)."""
    found: Dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    found[id(sub)] = sub
    return list(found.values())


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


def _names_a_family(node: ast.AST) -> bool:
    """A string constant, or a literal tuple/list/set of them (``model_type == "T5"``, ``model_type in ("BERT",)``);
    a comparison with a named table (the converter's supported types) or an enum is not a family branch."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_names_a_family(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _family(rel: str) -> str:
    parts = rel.split("/")
    return parts[2] if len(parts) > 3 and parts[1] == "models" else ""


def figures(root: Path) -> dict:
    """Every figure of the module docstring for the checkout at `root`."""
    lines = fl_total = fl_in_tree = 0
    private, getattrs, long_fns, ports, branches, flag_layer, cross, args_writes = [], [], 0, 0, [], [], [], {}
    for rel, tree, text in _modules(root):
        lines += len(text.splitlines())
        inner = function_level_imports(tree)
        fl_total += len(inner)
        fl_in_tree += sum(_imported(i, rel)[0].split(".")[0] == "megatron" for i in inner)
        src_lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                private += [f"{rel}: {node.module}:{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long_fns += 1
                ports += any("# port of Megatron's " in ln for ln in src_lines[node.lineno - 1:node.end_lineno])
            if isinstance(node, ast.Compare) and rel.startswith("megatron/checkpoint/"):
                left = node.left
                name = left.attr if isinstance(left, ast.Attribute) else getattr(left, "id", "")
                if name == "model_type" and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                for op in node.ops) and any(_names_a_family(c) for c in node.comparators):
                    branches.append(f"{rel}:{node.lineno}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _imported(node, rel)
                if rel.startswith("megatron/checkpoint/") and any(n in FLAG_LAYER or n.startswith(
                        tuple(f"{m}." for m in FLAG_LAYER)) for n in names):
                    flag_layer.append(f"{rel}:{node.lineno}")
                own = _family(rel)
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
