"""How many times each command-line setting is declared in the source (issue 23's "declared once" figure).

A static scan (no imports, so it measures any checkout the same way). A setting is a destination of Megatron's
parser: the core flags and the flags an entry script adds (an entry script: a file under the top folder, tasks/
or tools/ that calls initialize_megatron or pretrain under ``__main__``, as tests/test_every_flag.py finds them);
the separate command-line programs under tools/ (converters, benchmarks, preprocessing) have their own flags and
are not counted. Each of these places counts once per setting:

* megatron/arguments.py, megatron/settings/moe_checks.py or an entry script whose ``add_argument(...)`` calls add it (the
  --no- form of a flag in the same file is the same place);
* its ``setting(...)`` declaration (megatron/settings/);
* each hand-written table that names it: ``CONFIG_FIELDS`` (every source destination of an entry),
  ``ARCHITECTURE_FIELDS``, ``FILLED_IF_UNSET``, ``_FLAG_OF_FIELD``, ``_RESTORE`` (config-field names, mapped to the
  destination that feeds them), ``RUNTIME_SETTINGS``, ``_ENTRY_SCRIPT_SETTINGS``, ``_NOT_DECLARED``,
  ``SAME_RESULT_VARIANTS``, ``REFUSED``, ``FAMILY_ONLY``. A table computed from the declarations is not a literal and is not counted.

Usage: ``python tools/count_setting_declarations.py [--list] [ROOT]`` prints the number of settings, how many are
declared 1, 2, 3, ... times, and (``--list``) each setting declared more than once with its places.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

SCANNED = ("megatron", "tasks", "tools")
FIELD_TABLES = ("ARCHITECTURE_FIELDS", "_FLAG_OF_FIELD", "_RESTORE")  # keyed by config-field name
DEST_TABLES = ("FILLED_IF_UNSET", "RUNTIME_SETTINGS", "_ENTRY_SCRIPT_SETTINGS", "_NOT_DECLARED", "SAME_RESULT_VARIANTS",
               "REFUSED", "FAMILY_ONLY")
_WORDS = ("add_argument", "setting(", "CONFIG_FIELDS") + FIELD_TABLES + DEST_TABLES  # a file without any: skipped


def _files(root: Path) -> Iterator[Path]:
    yield from sorted(root.glob("*.py"))
    for top in SCANNED:
        yield from sorted((root / top).rglob("*.py"))


def _parser_file(rel: str, text: str) -> bool:
    """A file whose add_argument calls add flags to Megatron's parser (see the module docstring)."""
    if rel in ("megatron/arguments.py", "megatron/settings/moe_checks.py"):
        return True
    return not rel.startswith("megatron/") and bool(re.search(r"\b(initialize_megatron|pretrain)\(", text)) and \
        '__name__ == "__main__"' in text


def _strings(node: ast.AST) -> List[str]:
    """The string constants of a literal tuple/list/set, or of a dict's keys."""
    if isinstance(node, ast.Dict):
        return [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _assigned(tree: ast.AST) -> Iterator[Tuple[str, ast.AST]]:
    """(name, value) of every module-level `NAME = ...` / `NAME: T = ...`."""
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    yield target.id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            yield node.target.id, node.value


def _add_argument_dest(call: ast.Call) -> Optional[str]:
    for kw in call.keywords:
        if kw.arg == "dest" and isinstance(kw.value, ast.Constant):
            return kw.value.value
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if not flags:
        return None
    longs = [f for f in flags if f.startswith("--")]
    return (longs or flags)[0].lstrip("-").replace("-", "_")


def _config_sources(value: ast.AST) -> Dict[str, List[str]]:
    """A literal CONFIG_FIELDS: field -> its source destinations (`_copy("dest")` or `(("dest", ...), getter)`)."""
    out: Dict[str, List[str]] = {}
    if not isinstance(value, ast.Dict):
        return out
    for key, val in zip(value.keys, value.values):
        if not isinstance(key, ast.Constant):
            continue
        if isinstance(val, ast.Call) and val.args and isinstance(val.args[0], ast.Constant):
            out[key.value] = [val.args[0].value]
        elif isinstance(val, ast.Tuple) and val.elts:
            out[key.value] = _strings(val.elts[0])
    return out


def count(root: Path) -> Dict[str, Set[str]]:
    """Setting (destination) -> the places that declare it."""
    places: Dict[str, Set[str]] = {}
    field_tables: List[Tuple[str, List[str]]] = []
    config_sources: Dict[str, List[str]] = {}
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        if not any(word in text for word in _WORDS):
            continue  # (parsing every file of the tree is what takes the time)
        tree = ast.parse(text)
        for node in ast.walk(tree) if _parser_file(rel, text) else ():
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name == "add_argument":
                dest = _add_argument_dest(node)
                if dest:
                    places.setdefault(dest, set()).add(f"{rel}: add_argument")
        if rel.startswith("megatron/settings/"):
            for node in ast.walk(tree):
                if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call) and \
                        getattr(node.value.func, "id", None) == "setting":
                    places.setdefault(node.target.id, set()).add(f"{rel}: setting")
        for name, value in _assigned(tree):
            if name == "CONFIG_FIELDS":
                config_sources.update(_config_sources(value))
                for dests in _config_sources(value).values():
                    for dest in dests:
                        places.setdefault(dest, set()).add(f"{rel}: CONFIG_FIELDS")
            elif name in FIELD_TABLES:
                field_tables.append((f"{rel}: {name}", _strings(value)))
            elif name in DEST_TABLES:
                for dest in _strings(value):
                    places.setdefault(dest, set()).add(f"{rel}: {name}")
    for place, fields in field_tables:
        for field in fields:
            dest = (config_sources.get(field) or [field])[0]
            places.setdefault(dest, set()).add(place)
    return places


def summary(places: Dict[str, Set[str]]) -> Tuple[int, Dict[int, int]]:
    """(number of settings, {declarations: how many settings have that many})."""
    return len(places), dict(sorted(Counter(len(p) for p in places.values()).items()))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]),
                        help="repository checkout to scan (default: this one)")
    parser.add_argument("--list", action="store_true", help="list every setting declared more than once")
    ns = parser.parse_args(argv)
    places = count(Path(ns.root))
    total, histogram = summary(places)
    more = sum(n for k, n in histogram.items() if k > 1)
    print(f"{total} settings; declared once: {histogram.get(1, 0)}, more than once: {more} "
          f"(max {max(histogram)} times); by count: {histogram}")
    if ns.list:
        for dest in sorted(places, key=lambda d: (-len(places[d]), d)):
            if len(places[dest]) > 1:
                print(f"  {dest}: {len(places[dest])}: {'; '.join(sorted(places[dest]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
