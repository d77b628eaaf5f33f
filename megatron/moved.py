"""Megatron's import paths of the modules that moved: the shared layers (``megatron.model`` -> megatron/layers/), the
model families (megatron/models/<family>/), the checkpoint code and its conversion library (megatron/checkpoint/,
megatron/checkpoint/conversion/) and the flag layer (megatron/settings/). The one alias mechanism of the house:
importing ``megatron.model.bert_model`` gives the very module ``megatron.models.bert.model``,
``megatron.model.transformer`` the very module ``megatron.layers.transformer``, ``megatron.checkpointing`` the very
module ``megatron.compat`` (Megatron's args-taking checkpoint functions over the run-time layer in megatron/checkpoint/;
same objects, so monkeypatching either name patches both; no file stays at the old path). An old package that also exported names now defined elsewhere (``from megatron.model import
GPTModel``) is a small proxy module: its names resolve to the new package's or to MOVED_NAMES' modules (setting an
attribute on the proxy does not reach them). Installed by megatron/__init__.py; nothing else to keep in sync."""
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
    "megatron.checkpointing": "megatron.compat",
    "megatron.checkpoint.checkpointing": "megatron.compat",
    "megatron.checkpoint_args": "megatron.checkpoint.args",
    "megatron.checkpoint_formats": "megatron.checkpoint.formats",
    "megatron.checkpoint_integrity": "megatron.checkpoint.integrity",
    "megatron.safe_load": "megatron.checkpoint.safe_load",
    "megatron.atomic_io": "megatron.checkpoint.atomic_io",
    "megatron.cli_parser": "megatron.settings.cli_parser",
    "megatron.config_flags": "megatron.settings.config_flags",
    "megatron.flag_registry": "megatron.settings.flag_registry",
    "megatron.required_flags": "megatron.settings.required_flags",
    "megatron.moe_arguments": "megatron.settings.moe_checks",
    "megatron.run_settings": "megatron.run_configs.run_settings",
}
# Whole packages that moved: every module under the old prefix is the module under the new one.
MOVED_PACKAGES = {
    "megatron.checkpoint_conversion": "megatron.checkpoint.conversion",
    "megatron.model": "megatron.layers",
}
# Names an old package exported that are now defined outside the package it moved to (Megatron's
# ``from megatron.model import GPTModel, BertModel, T5Model``): old package -> {name: module defining it}.
MOVED_NAMES = {
    "megatron.model": {
        "GPTModel": "megatron.models.gpt.model",
        "post_language_model_processing": "megatron.models.gpt.model",
        "BertModel": "megatron.models.bert.model",
        "T5Model": "megatron.models.t5.model",
    },
}


def new_name(fullname: str) -> Optional[str]:
    """The module an old import path now names, or None when it did not move."""
    if fullname in MOVED_MODULES:
        return MOVED_MODULES[fullname]
    for old, new in MOVED_PACKAGES.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old):]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__  # the import machinery sets the alias's spec on it; exec_module puts it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # already executed under its new name


class _Proxy(importlib.abc.Loader):
    """An old package with MOVED_NAMES: a module of its own whose attributes are the new package's plus those names."""

    def __init__(self, fullname: str, target: str) -> None:
        self.fullname, self.target = fullname, target

    def create_module(self, spec: Any) -> ModuleType:
        package = importlib.import_module(self.target)
        names = MOVED_NAMES[self.fullname]
        proxy = ModuleType(self.fullname, package.__doc__)

        def resolve(name: str) -> Any:
            if name in names:
                return getattr(importlib.import_module(names[name]), name)
            try:
                return getattr(package, name)
            except AttributeError:
                raise AttributeError(f"module {self.fullname!r} has no attribute {name!r}") from None

        proxy.__getattr__ = resolve  # type: ignore[method-assign]
        proxy.__dir__ = lambda: sorted({*dir(package), *names})  # type: ignore[method-assign]
        proxy.__path__ = []  # a package: its submodules are found by MovedModuleFinder (first on the path)
        return proxy

    def exec_module(self, module: ModuleType) -> None:
        pass


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of MOVED_MODULES as aliases of the new modules."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        target = new_name(fullname)
        if target is None:
            return None
        if fullname in MOVED_NAMES:
            return importlib.util.spec_from_loader(fullname, _Proxy(fullname, target), is_package=True)
        return importlib.util.spec_from_loader(fullname, _Alias(target))


def install() -> None:
    # First on the path: a submodule of a moved package would otherwise be found again through the package's
    # __path__ and loaded a second time under its old name.
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
