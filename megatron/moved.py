"""Megatron's import paths of the modules that moved: the model families (megatron/models/<family>/) and the checkpoint
code (megatron/checkpoint/). Importing ``megatron.model.bert_model`` gives the very module ``megatron.models.bert.model``,
``megatron.checkpointing`` the very module ``megatron.checkpoint.checkpointing`` (same objects, so monkeypatching either
name patches both; no file stays at the old path). Installed by megatron/__init__.py; nothing else to keep in sync."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

MOVED_MODULES = {
    "megatron.model.gpt_model": "megatron.models.gpt.model",
    "megatron.model.gpt_model_pipe": "megatron.models.gpt.model_pipe",
    "megatron.model.bert_model": "megatron.models.bert.model",
    "megatron.model.classification": "megatron.models.bert.classification",
    "megatron.model.multiple_choice": "megatron.models.bert.multiple_choice",
    "megatron.model.t5_model": "megatron.models.t5.model",
    "megatron.model.moved": "megatron.moved",
    "megatron.checkpointing": "megatron.checkpoint.checkpointing",
    "megatron.checkpoint_args": "megatron.checkpoint.args",
    "megatron.checkpoint_formats": "megatron.checkpoint.formats",
    "megatron.checkpoint_integrity": "megatron.checkpoint.integrity",
    "megatron.safe_load": "megatron.checkpoint.safe_load",
    "megatron.atomic_io": "megatron.checkpoint.atomic_io",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__  # the import machinery sets the alias's spec on it; exec_module puts it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # already executed under its new name


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of MOVED_MODULES as aliases of the new modules."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(MOVED_MODULES[fullname]))


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
