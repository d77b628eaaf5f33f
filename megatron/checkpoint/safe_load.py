"""Safe checkpoint loading: no code runs from a checkpoint file unless the user says they trust it.

Every ``torch.load`` of the project goes through `safe_torch_load`: weights-only unpickling (tensors, containers,
numbers, strings, torch dtypes/sizes) plus an explicit allow-list of the other types that Megatron, Megatron-DeepSpeed
and DeepSpeed 0.19 checkpoints legitimately contain (argparse namespaces, numpy RNG state, our model enums,
DeepSpeed's loss scalers and ZeRO enums; see `ALLOWED_GLOBALS`). A file that needs anything else is refused with one
line naming the file and the offending type. The opt-in for files the user trusts is ``--trust-checkpoint`` (passed as
``trust=True``) or the environment variable ``MEGATRON_TRUST_CHECKPOINT=1``; it loads with full unpickling.

DeepSpeed's ``engine.load_checkpoint`` (and ``zero_to_fp32``) call ``torch.load(..., weights_only=False)``
internally; `guarded_torch_load` routes those calls through the same safe loader for the duration of a block.

A file that is truncated, empty or not a torch file at all raises `CheckpointFileError` (one line naming the file),
which the checkpoint loader uses to fall back to an older iteration.
"""
from __future__ import annotations

import contextlib
import contextvars
import enum
import importlib
import os
import pickle
import re
import sys
import threading
from typing import Any, Iterator, Optional

import torch

from megatron.errors import MegatronUserError

TRUST_ENV = "MEGATRON_TRUST_CHECKPOINT"
TRUST_HINT = (f"only if you trust this file, pass --trust-checkpoint (or set {TRUST_ENV}=1) to load it with full "
              "unpickling")

# "module:qualname" of every non-tensor global our checkpoints and Megatron's/DeepSpeed's contain. Resolved lazily;
# an entry whose module is not installed is skipped (a file that needs it could not be loaded anyway).
ALLOWED_GLOBALS: tuple[str, ...] = (
    # Megatron args and RNG state
    "argparse:Namespace",
    "types:SimpleNamespace",  # args of checkpoints written by Megatron-LM's conversion tools (model fields only)
    "numpy:ndarray",
    "numpy:dtype",
    "numpy._core.multiarray:_reconstruct",
    "numpy.core.multiarray:_reconstruct",
    "numpy._core.multiarray:scalar",
    "numpy.core.multiarray:scalar",
    "numpy.dtypes:UInt32DType",
    "numpy.dtypes:Int64DType",
    "numpy.dtypes:Int32DType",
    "numpy.dtypes:Float64DType",
    "numpy.dtypes:Float32DType",
    "numpy.dtypes:BoolDType",
    # our model enums (args.model_type, attention mask types, ...)
    "megatron.model.enums:ModelType",
    "megatron.model.enums:LayerType",
    "megatron.model.enums:AttnType",
    "megatron.model.enums:AttnMaskType",
    # Megatron Core's enum: args.model_type of Megatron-LM's checkpoints and of our torch_dist common.pt
    "megatron.core.enums:ModelType",
    # Megatron-DeepSpeed's (BigScience's BLOOM checkpoints) enums in their args; stand-ins in megatron/enums.py
    "megatron.enums:PositionEmbeddingType",
    "megatron.enums:AttnMaskType",
    "megatron.enums:LayerType",
    "megatron.enums:AttnType",
    # DeepSpeed 0.19 model/optimizer state files
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
    "deepspeed.runtime.zero.config:ZeroStageEnum",
    "deepspeed.runtime.zero.offload_config:OffloadDeviceEnum",
    "deepspeed.utils.tensor_fragment:fragment_address",
    "deepspeed.checkpoint.constants:ZeroStageEnum",
    "collections:defaultdict",
    "builtins:set",
    "builtins:frozenset",
    "builtins:slice",
    "builtins:complex",
)

_RESOLVED: dict[str, Any] = {}
_TRUST_IN_BLOCK: contextvars.ContextVar[bool] = contextvars.ContextVar("megatron_trust_checkpoint", default=False)
_GUARD_LOCK = threading.Lock()
_UNSUPPORTED_RE = re.compile(r"(?:GLOBAL|global)\s+([\w.]+(?:\.[\w]+)*)")


class UnsafeCheckpointError(MegatronUserError, RuntimeError):
    """A checkpoint file needs a type outside the safe-load allow-list (it could run code)."""


class CheckpointFileError(MegatronUserError, RuntimeError):
    """A checkpoint file is missing, empty, truncated or not a torch file."""


def trust_from_env() -> bool:
    """MEGATRON_TRUST_CHECKPOINT=1/true/yes opts in to full unpickling."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _resolve(spec: str) -> Any:
    module_name, _, qualname = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr`` as unpickling may call it: Python 3.11.0-3.11.4 pickle an enum member as ``getattr(Enum, 'name')``
    (Debian 12's python3 writes `args.model_type` so). Only a member of an allow-listed Enum is returned."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and any(cls is o for o in allowed_globals(False))
            and isinstance(name, str) and name in cls.__members__):
        raise pickle.UnpicklingError(f"Weights only load failed: Unsupported global: GLOBAL builtins.getattr "
                                     f"on {getattr(cls, '__name__', type(cls).__name__)}.{name}")
    return cls.__members__[name]


def allowed_globals(enum_by_name: bool = True) -> list[Any]:
    """The allow-list objects whose modules are already imported (DeepSpeed is never imported just for this;
    `safe_torch_load` imports an allowed module on demand when a file needs it), and ``getattr`` restricted to
    members of the allow-listed enums (`_enum_member`)."""
    resolved: list[Any] = [(_enum_member, "builtins.getattr")] if enum_by_name else []
    for spec in ALLOWED_GLOBALS:
        module_name = spec.partition(":")[0]
        if module_name.split(".")[0] not in sys.modules and module_name.startswith("deepspeed"):
            continue
        if spec not in _RESOLVED:
            try:
                _RESOLVED[spec] = _resolve(spec)
            except (ImportError, AttributeError):
                _RESOLVED[spec] = None
        if _RESOLVED[spec] is not None:
            resolved.append(_RESOLVED[spec])
    return resolved


def _allowed_spec(dotted: str) -> Optional[str]:
    """'deepspeed.runtime.fp16.loss_scaler.LossScaler' -> its ALLOWED_GLOBALS entry, if any."""
    for spec in ALLOWED_GLOBALS:
        if spec.replace(":", ".") == dotted:
            return spec
    return None


def _offending_type(exc: BaseException) -> str:
    text = str(exc)
    m = _UNSUPPORTED_RE.search(text)
    if m:
        return m.group(1)
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Weights only load failed", "Please file", "Check the", "(1)", "(2)",
                                         "In PyTorch", "WeightsUnpickler")):
            return line[:160]
    return type(exc).__name__


def _name(f: Any) -> str:
    return os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", repr(f))


def safe_torch_load(f: Any, map_location: Any = "cpu", *, trust: Optional[bool] = None, mmap: Optional[bool] = None
                    ) -> Any:
    """``torch.load`` that refuses to run code: weights-only with `ALLOWED_GLOBALS` unless ``trust`` (or the env var).

    Raises UnsafeCheckpointError (offending type named) or CheckpointFileError (unreadable file), both one line.
    """
    name = _name(f)
    if isinstance(f, (str, os.PathLike)):
        if not os.path.isfile(f):
            raise CheckpointFileError(f"checkpoint file {name} does not exist")
        if os.path.getsize(f) == 0:
            raise CheckpointFileError(f"checkpoint file {name} is empty (0 bytes): a crashed or interrupted write")
    trusted = bool(trust) or (trust is None and _TRUST_IN_BLOCK.get()) or trust_from_env()
    kwargs: dict[str, Any] = {"map_location": map_location}
    if mmap is not None:
        kwargs["mmap"] = mmap
    try:
        if trusted:
            return _ORIGINAL_TORCH_LOAD(f, weights_only=False, **kwargs)
        for _ in range(len(ALLOWED_GLOBALS) + 1):
            try:
                with torch.serialization.safe_globals(allowed_globals()):
                    return _ORIGINAL_TORCH_LOAD(f, weights_only=True, **kwargs)
            except pickle.UnpicklingError as exc:
                spec = _allowed_spec(_offending_type(exc))
                if spec is None or _RESOLVED.get(spec) is not None:
                    raise
                try:
                    _RESOLVED[spec] = _resolve(spec)  # e.g. DeepSpeed's loss scaler: import it, then retry
                except (ImportError, AttributeError):
                    raise exc from None
                if hasattr(f, "seek"):
                    f.seek(0)
        raise pickle.UnpicklingError("Weights only load failed: the allow-list did not converge")
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc) or "Unsupported" in str(exc):
            raise UnsafeCheckpointError(
                f"refusing to load {name}: it needs '{_offending_type(exc)}', which is not on the safe-load "
                f"allow-list and could run code; {TRUST_HINT}") from None
        raise CheckpointFileError(f"checkpoint file {name} is damaged ({str(exc).splitlines()[0][:160]})") from None
    except (EOFError, RuntimeError, ValueError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointFileError(f"checkpoint file {name} is truncated or damaged ({type(exc).__name__}: "
                                  f"{first})") from None


_ORIGINAL_TORCH_LOAD = torch.load


@contextlib.contextmanager
def guarded_torch_load(trust: Optional[bool] = None) -> Iterator[None]:
    """Inside the block every ``torch.load`` (DeepSpeed's internal ones included) is `safe_torch_load`, and
    ``safe_torch_load(trust=None)`` takes ``trust`` as its default."""

    def patched(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: Any = None,
                mmap: Optional[bool] = None, **_: Any) -> Any:
        del pickle_module, weights_only  # callers cannot opt out of the safe loader
        return safe_torch_load(f, map_location=map_location, trust=trust, mmap=mmap)

    token = _TRUST_IN_BLOCK.set(bool(trust))
    with _GUARD_LOCK:
        previous = torch.load
        torch.load = patched
    try:
        yield
    finally:
        with _GUARD_LOCK:
            torch.load = previous
        _TRUST_IN_BLOCK.reset(token)
