"""House rule (issue #36): nothing under megatron/ writes onto Megatron's ``args`` outside the start-up pipeline.

An AST scan finds every attribute write on a namespace named ``args`` or ``flags`` (``args.x = ...``,
``configs.flags.x = ...``, ``args.x += ...``, ``setattr(args, ...)``, ``vars(args).update(...)``). Each write
outside the start-up modules is listed below with why it may stay; the list must match the scan exactly, so it
shrinks as writes go. At run time `megatron.startup.StartupArgs` refuses the same writes from our code
(tests/test_startup.py).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Set

from megatron.startup import RECORDED_AFTER_START_UP

ROOT = Path(__file__).resolve().parents[1]

# The start-up pipeline: these build the args record (on their own working copy) before it is assembled.
START_UP = {
    "megatron/arguments.py",  # parse and validation: fills the derived values on validation's own copy (and
    # Megatron's validate_args, for users' scripts, writes that copy back onto its caller's namespace)
    "megatron/settings/moe_checks.py",  # validate_moe_args: part of validation (its copy)
    "megatron/checkpoint/args.py",  # restore_architecture: --use-checkpoint-args, on the restore step's copy
}

# file:function -> why the write stays. None of them writes onto the args start-up assembled (get_args()).
OTHER_NAMESPACES = {
    # Megatron's APIs whose contract is to record on the caller's namespace (users' scripts, tools); start-up does
    # not call them (it calls the steps in megatron/startup.py).
    "megatron/global_vars.py:_build_tokenizer": "set_global_variables(args): Megatron's API records padded_vocab_size",
    "megatron/tokenizer/tokenizer.py:build_tokenizer": "Megatron's build_tokenizer(args) records padded_vocab_size",
    "megatron/ds/config.py:apply_to": "resolve_deepspeed_config(args): writes the settled values on its caller's "
                                      "namespace (start-up uses settled_values)",
    "megatron/compat.py:_set_flags": "Megatron's load_args_from_checkpoint(args) and friends fill their caller's "
                                     "namespace (start-up's restore step takes restored_flag_values instead)",
    "megatron/training_state.py:write_counters": "the consumed samples (RECORDED_AFTER_START_UP) by a computed "
                                                 "name, for callers that keep run state on their namespace",
    # Namespaces of our tools, not Megatron's args.
    "megatron/data/preprocessing.py:finish_args": "tools/preprocess_data.py's own flags",
    "megatron/quiet_torchrun.py:take_over_sigterm": "the launcher wrapper's own flags",
    "megatron/checkpoint/conversion/driver.py:parse_args": "tools/checkpoint/convert.py's own flags",
    "megatron/checkpoint/conversion/driver.py:_check_args": "tools/checkpoint/convert.py's own flags",
    "megatron/checkpoint/conversion/driver.py:convert": "tools/checkpoint/convert.py's own flags",
    "megatron/checkpoint/conversion/megatron_format.py:_saved_args": "the args a converted checkpoint stores",
    "megatron/models/bert/checkpoint_layout.py:bert_saved_args": "BERT's entry in the args a converted checkpoint "
                                                                 "stores (called by megatron_format._saved_args)",
    "megatron/checkpoint/conversion/deepspeed_format.py:write_deepspeed": "the args a written DeepSpeed checkpoint "
                                                                         "stores",
}


def _is_args(node: ast.AST) -> bool:
    """`args` or `<anything>.flags` (RunConfigs.flags is the args record)."""
    return (isinstance(node, ast.Name) and node.id == "args") or (isinstance(node, ast.Attribute)
                                                                   and node.attr == "flags")


def _targets(node: ast.AST) -> List[ast.AST]:
    if isinstance(node, ast.Assign):
        out: List[ast.AST] = []
        for target in node.targets:
            out += list(target.elts) if isinstance(target, ast.Tuple) else [target]
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def args_writes(source: str) -> List[str]:
    """`function:attribute` for each write onto an args namespace in `source` (`?` when the name is computed)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            for target in _targets(child):
                if isinstance(target, ast.Attribute) and _is_args(target.value):
                    found.append(f"{name}:{target.attr}")
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "setattr" \
                    and child.args and _is_args(child.args[0]):
                attr = child.args[1].value if isinstance(child.args[1], ast.Constant) else "?"
                found.append(f"{name}:{attr}")
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "update" \
                    and isinstance(child.func.value, ast.Call) and getattr(child.func.value.func, "id", "") == "vars" \
                    and child.func.value.args and _is_args(child.func.value.args[0]):
                found.append(f"{name}:?")
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def test_the_scan_finds_each_kind_of_write() -> None:
    src = ("def f(args, configs):\n    args.a = 1\n    args.b, x = 2, 3\n    args.c += 1\n    setattr(args, 'd', 4)\n"
           "    configs.flags.e = 5\n    vars(args).update({})\n    other.g = 6\n    y = args.h\n")
    assert args_writes(src) == ["f:a", "f:b", "f:c", "f:d", "f:e", "f:?"]


def _writes_outside_start_up() -> Set[str]:
    found = set()
    for path in sorted((ROOT / "megatron").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in START_UP:
            continue
        for hit in args_writes(path.read_text(encoding="utf-8")):
            function, attr = hit.split(":")
            if attr not in RECORDED_AFTER_START_UP:  # Megatron's own set-up records them (megatron/startup.py)
                found.add(f"{rel}:{function}")
    return found


def test_no_module_writes_args_outside_start_up() -> None:
    assert _writes_outside_start_up() == set(OTHER_NAMESPACES)
