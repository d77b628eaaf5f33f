"""The optional heavy dependencies in one room: one accessor per package, imported on first use.

Importing megatron stays cheap and runs without DeepSpeed, NLTK, Triton, pybind11, ... installed; a module that
needs one calls its accessor where it uses it (``optional.deepspeed().initialize(...)``,
``optional.deepspeed("pipe").PipelineModule``) instead of repeating an import statement inside a function. A
missing package raises ModuleNotFoundError (an ImportError, so ``except ImportError`` fallbacks keep working) whose
message is one line naming the package and how to install it; any other import failure propagates unchanged.

torch is a hard dependency of training but not of the light paths (tools/preprocess_data*.py and
megatron.data.indexed_dataset never import it), so the data modules reach torch.distributed through here too.
This module imports nothing of megatron: every layer may use it.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# package -> the pip command that installs it
INSTALL = {
    "deepspeed": "pip install deepspeed",
    "nltk": "pip install nltk",
    "pybind11": "pip install pybind11",
    "torch": "pip install torch",
    "triton": "pip install triton",
}


def load(package: str, submodule: str = "") -> ModuleType:
    """`package` (or `package.submodule`), imported on first use; a missing `package` is one line with its install
    command (ModuleNotFoundError, ``name`` = the package)."""
    name = f"{package}.{submodule}" if submodule else package
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != package:
            raise
        install = INSTALL.get(package, f"pip install {package}")
        raise ModuleNotFoundError(f"{name} is needed here but {package} is not installed ({install})",
                                  name=package) from None


def deepspeed(submodule: str = "") -> ModuleType:
    """``deepspeed`` or ``deepspeed.<submodule>`` (the --deepspeed path; DeepSpeed takes seconds to import)."""
    return load("deepspeed", submodule)


def nltk(submodule: str = "") -> ModuleType:
    """``nltk`` or ``nltk.<submodule>`` (installed Punkt data and the reference splitter; ~1.3 s to import)."""
    return load("nltk", submodule)


def pybind11() -> ModuleType:
    """``pybind11`` (compiling the dataset helpers from csrc/ when no prebuilt module is installed)."""
    return load("pybind11")


def triton() -> ModuleType:
    """``triton`` (the fused kernels in megatron/fused_kernels/)."""
    return load("triton")


def torch_distributed() -> ModuleType:
    """``torch.distributed`` for the torch-free data modules (they use it only inside a training run)."""
    return load("torch", "distributed")
