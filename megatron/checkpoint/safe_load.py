"""Safe checkpoint loading: no code runs from a checkpoint file unless the user says they trust it.

Every ``torch.load`` of the project goes through `safe_torch_load`: weights-only unpickling (tensors, containers,
numbers, strings, torch dtypes/sizes) plus an explicit allow-list of the other types that Megatron, Megatron-DeepSpeed
and DeepSpeed 0.19 checkpoints legitimately contain (argparse namespaces, numpy RNG state, our model enums,
DeepSpeed's loss scalers and ZeRO enums; see `ALLOWED_GLOBALS`). A file that needs anything else is refused with one
line naming the file and the offending type. The opt-in for files the user trusts is ``--trust-checkpoint`` (passed as
``trust=True``) or the environment variable ``MEGATRON_TRUST_CHECKPOINT=1``; it loads with full unpickling.

DeepSpeed's ``engine.load_checkpoint`` (and ``zero_to_fp32``) call ``torch.load(..., weights_only=False)``
internally; `guarded_torch_load` routes those calls through the same safe loader for the duration of a block.

Every allow-list names classes and functions, never a module: an exact ``module:qualname`` pair, a dotted qualname
only where it is listed as such, and no attribute walk through an allowed module (torch's weights-only unpickler gets
each entry under the exact name listed, whatever the object's ``__module__`` says). Pickles that are not torch files
(torch.distributed.checkpoint's ``.metadata``) go through `restricted_pickle_load`, which also limits what the
allowed objects may be used for (see `RestrictedUnpickler`).

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
from typing import Any, BinaryIO, Iterator, Mapping, Optional

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
    # our model enums (args.model_type, ...) by the path checkpoints pickle them under (megatron/layers/enums.py)
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
    (Debian 12's python3 writes `args.model_type` so). Only a member of an allow-listed Enum is returned (looked up in
    ``__members__``: never an attribute, a method or a module)."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and any(cls is o for o, _ in allowed_globals(False))
            and isinstance(name, str) and name in cls.__members__):
        raise pickle.UnpicklingError(f"Weights only load failed: Unsupported global: GLOBAL builtins.getattr "
                                     f"on {getattr(cls, '__name__', type(cls).__name__)}.{name}")
    return cls.__members__[name]


def allowed_globals(enum_by_name: bool = True) -> list[tuple[Any, str]]:
    """``(object, "module.qualname")`` of each allow-list entry whose module is already imported (DeepSpeed is never
    imported just for this; `safe_torch_load` imports an allowed module on demand when a file needs it), and
    ``getattr`` restricted to members of the allow-listed enums (`_enum_member`). The pairs are what
    ``torch.serialization.safe_globals`` takes: each object is found only under the exact name listed (numpy 1.x's
    ``numpy.core.multiarray._reconstruct`` as well as numpy 2's ``numpy._core...``), never by its ``__module__``."""
    resolved: list[tuple[Any, str]] = [(_enum_member, "builtins.getattr")] if enum_by_name else []
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
            resolved.append((_RESOLVED[spec], spec.replace(":", ".")))
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


def _trusted(trust: Optional[bool]) -> bool:
    return bool(trust) or (trust is None and _TRUST_IN_BLOCK.get()) or trust_from_env()


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
    trusted = _trusted(trust)
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
    except (EOFError, RuntimeError, ValueError, OSError, TypeError, AttributeError, KeyError, IndexError) as exc:
        # (the last four: an allowed function called with arguments it refuses, e.g. numpy's _reconstruct)
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


class _Refused(pickle.UnpicklingError):
    """A pickle asked for something off the allow-list; ``what`` names it."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class RestrictedUnpickler(pickle._Unpickler):
    """The pure-Python unpickler narrowed to an exact allow-list ``{"module:qualname": object}``.

    GLOBAL, STACK_GLOBAL and INST get an object only when their (module, name) pair is listed as it stands (a dotted
    name only where the dotted name itself is listed; no import, no attribute walk); REDUCE, NEWOBJ, NEWOBJ_EX, OBJ
    and INST call only a listed object; BUILD sets the state of an instance of a listed class only (never of a class,
    a function or an enum member); items go into lists, dicts and sets (or listed subclasses) only; the copyreg
    extension opcodes (EXT1/2/4) and persistent ids are refused. The C unpickler cannot be narrowed past
    ``find_class``, hence the Python one (2.5-5x slower: fine for metadata-sized pickles)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: BinaryIO, allowed: Mapping[str, Any]) -> None:
        super().__init__(file)
        self._allowed = dict(allowed)
        self._callable_ids = {id(o) for o in self._allowed.values() if callable(o)}
        self._class_ids = {id(o) for o in self._allowed.values()
                           if isinstance(o, type) and not issubclass(o, enum.Enum)}

    def find_class(self, module: str, name: str) -> Any:
        """The listed object named exactly `module`:`name`, else refused."""
        obj = self._allowed.get(f"{module}:{name}", _Refused)
        if obj is _Refused:
            raise _Refused(f"{module}.{name}")
        return obj

    def _check_call(self, func: Any) -> None:
        if id(func) not in self._callable_ids:
            raise _Refused(f"a call of {getattr(func, '__qualname__', type(func).__qualname__)}")

    def _load_reduce(self) -> None:
        self._check_call(self.stack[-2])
        pickle._Unpickler.load_reduce(self)

    def _load_newobj(self) -> None:
        self._check_call(self.stack[-2])
        pickle._Unpickler.load_newobj(self)

    def _load_newobj_ex(self) -> None:
        self._check_call(self.stack[-3])
        pickle._Unpickler.load_newobj_ex(self)

    def _instantiate(self, klass: Any, args: list) -> None:  # OBJ and INST
        self._check_call(klass)
        super()._instantiate(klass, args)

    def _load_build(self) -> None:
        inst = self.stack[-2]
        if id(type(inst)) not in self._class_ids:
            raise _Refused(f"setting the state of {getattr(inst, '__qualname__', type(inst).__qualname__)}")
        pickle._Unpickler.load_build(self)

    def _check_container(self, target: Any, kind: type) -> None:
        if not (type(target) is kind or (isinstance(target, kind) and id(type(target)) in self._class_ids)):
            raise _Refused(f"adding items to {getattr(target, '__qualname__', type(target).__qualname__)}")

    def _load_appends(self) -> None:
        self._check_container(self.metastack[-1][-1], list)
        pickle._Unpickler.load_appends(self)

    def _load_append(self) -> None:
        self._check_container(self.stack[-2], list)
        pickle._Unpickler.load_append(self)

    def _load_setitems(self) -> None:
        self._check_container(self.metastack[-1][-1], dict)
        pickle._Unpickler.load_setitems(self)

    def _load_setitem(self) -> None:
        self._check_container(self.stack[-3], dict)
        pickle._Unpickler.load_setitem(self)

    def _load_additems(self) -> None:
        self._check_container(self.metastack[-1][-1], set)
        pickle._Unpickler.load_additems(self)

    def _load_ext(self) -> None:
        raise _Refused("a copyreg extension code (EXT opcode)")

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build
    dispatch[pickle.APPEND[0]] = _load_append
    dispatch[pickle.APPENDS[0]] = _load_appends
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.ADDITEMS[0]] = _load_additems
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _load_ext
    del _op


def restricted_pickle_load(f: BinaryIO, allowed: Mapping[str, Any], name: str, *, trust: Optional[bool] = None
                           ) -> Any:
    """Unpickle the open file `f` (called `name` in messages) with `RestrictedUnpickler` over `allowed`, or with
    full unpickling when trusted (``trust``, a trusting `guarded_torch_load` block, or the env var).

    Raises UnsafeCheckpointError (one line naming the file and what it asked for) for anything off the allow-list;
    other unpickling errors (a truncated or foreign file) propagate for the caller to word.
    """
    if _trusted(trust):
        return pickle.load(f)
    try:
        return RestrictedUnpickler(f, allowed).load()
    except _Refused as exc:
        raise UnsafeCheckpointError(
            f"refusing to load {name}: it needs '{exc.what}', which is not on the safe-load allow-list and could "
            f"run code; {TRUST_HINT}") from None
