"""tools/house_figures.py measures what it says on a small tree with one of each thing it counts, and family_cost
counts a commit range's library files outside a folder."""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("house_figures", ROOT / "tools" / "house_figures.py")
house_figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(house_figures)

FILES = {
    "megatron/__init__.py": "",
    "megatron/models/a/m.py": "from megatron.models.b import n\nfrom megatron.models.registry import r\n",
    "megatron/models/b/n.py": "def f(args):\n    import json\n    from . import m\n    args.x = 1\n    setattr(args, 'y', 2)\n",
    "megatron/models/registry.py": "r = 1\n",
    "megatron/checkpoint/f.py": ("from megatron.arguments import parse_args\nfrom megatron.x import _private\n"
                                 "def g(meta):\n    if meta.model_type == 'T5':\n        return 1\n"
                                 "    if args.model_type not in SUPPORTED or spec.model_type != pb.UNIGRAM:\n"
                                 "        return 2\n"
                                 "    return model_type in ('BERT',)\n"),
    "megatron/lazy.py": "def __getattr__(name):\n    raise AttributeError(name)\n",
}


def _tree(root: Path) -> None:
    for rel, text in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_each_figure_counts_its_one_instance(tmp_path):
    _tree(tmp_path)
    fig = house_figures.figures(tmp_path)
    assert fig["lines"] == sum(len(t.splitlines()) for t in FILES.values())
    assert fig["function_level_imports"] == 2 and fig["function_level_imports_in_tree"] == 1
    assert fig["private_imports_across_modules"] == ["megatron/checkpoint/f.py: megatron.x:_private"]
    assert fig["model_type_branches_in_checkpoint_code"] == ["megatron/checkpoint/f.py:4", "megatron/checkpoint/f.py:8"]
    assert fig["checkpoint_imports_of_the_flag_layer"] == ["megatron/checkpoint/f.py:1"]
    assert fig["family_imports_of_another_family"] == ["megatron/models/a/m.py:1 -> b"]
    assert fig["module_getattr"] == ["megatron/lazy.py"]
    assert fig["args_writes_per_file"] == {"megatron/models/b/n.py": 2}


def test_family_cost_counts_library_files_outside_the_folder(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    _tree(tmp_path)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "a"], check=True)
    for rel in ("megatron/models/a/new.py", "megatron/checkpoint/f.py", "pretrain_x.py", "tests/test_a.py",
                "docs/a.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "b"], check=True)
    assert house_figures.family_cost(tmp_path, "HEAD~1..HEAD", "megatron/models/a") == [
        "megatron/checkpoint/f.py", "pretrain_x.py"]
