"""Megatron-LM's ``--ckpt-format torch_dist`` folders, read and written (GPT, Llama-family, MoE, BERT and T5 models;
BERT's layers are stacked under ``encoder.layers.``, T5's under ``encoder.layers.`` and ``decoder.layers.``).

An iteration folder holds a `torch.distributed.checkpoint` save: ``.metadata`` (the tensors' global shapes and where
each chunk lives), ``__R_K.distcp`` data files, ``common.pt`` (the non-tensor state: ``args``, ``iteration``,
``checkpoint_version``...) and ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``). Each tensor is stored
once with its global (TP=1) shape under Megatron Core's name, the layers stacked on a leading axis
(``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, ...]``; SwiGLU's ``linear_fc1`` is
``[W; V]`` over the full width, i.e. our TP=1 tensor), whatever TP/PP/DP layout wrote it.

Reading is ours, on CPU and without a process group: ``.metadata`` is unpickled with an exact allow-list of
`torch.distributed.checkpoint`'s own record classes, torch's dtypes, ``torch.Size`` and the writer's path class
(`DCP_METADATA_GLOBALS`; megatron-core <= 0.15's ``MCoreMetadata``/``MCoreSavePlan`` read as torch's records; no
other object is ever built or called, see safe_load.RestrictedUnpickler), each tensor chunk is loaded
weights-only from the byte range the metadata names, and a missing or damaged data file is one line naming it.
Non-tensor entries (Transformer Engine's ``_extra_state``) are never unpickled. Writing goes through
`torch.distributed.checkpoint.save` (one process, ``no_dist``), so Megatron Core's ``dist_checkpointing.load`` reads
the result into its models at any layout.
"""
from __future__ import annotations

import copy
import enum
import functools
import importlib
import io
import json
import os
import shutil
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from megatron.checkpoint.args import saved_architecture
from megatron.checkpoint.atomic_io import (
    DiskFullError,
    atomic_torch_save,
    atomic_write_text,
    is_disk_full,
    tensor_bytes,
)
from megatron.checkpoint.conversion.interchange import (
    NO_ARGS_HINT,
    ConversionError,
    Message,
    ModelMeta,
    args_namespace,
    messages_from_state_dict,
    state_dict_from_messages,
)
from megatron.checkpoint.conversion.megatron_format import find_iteration_dir, verified_source
from megatron.checkpoint.conversion.t5_format import t5_messages_from_state_dict, t5_state_dict_from_messages
from megatron.checkpoint.conversion.torch_dist_buckets import BUCKETS, UNREADABLE, bucket_state
from megatron.checkpoint.conversion.torch_dist_optim import (
    PARAM,
    common_entry,
    optimizer_common,
    sharding_type,
    split_optimizer_tensors,
    state_tensors,
)
from megatron.checkpoint.safe_load import UnsafeCheckpointError, restricted_pickle_load, safe_torch_load
from megatron.core.enums import CORE_MODEL_TYPE
from megatron.errors import MegatronUserError
from megatron.layers.mcore_names import (
    MTP_LAYERS,
    OUR_EXPERTS,
    core_layer_suffix_to_ours,
    core_to_ours,
    experts_to_core,
    experts_to_ours,
    is_core_t5,
    is_our_bert,
    is_our_t5,
    mla_output_names,
    our_layer_suffix_to_core,
    ours_to_core,
)
from megatron.models import registry
from megatron.run_configs.saved_args import SavedRunArgs

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
DCP_METADATA = ".metadata"
_LAYERS = "language_model.encoder.layers."
_DCP = "torch.distributed.checkpoint."
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_MOE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.shared_experts.linear_fc1",
                "mlp.shared_experts.linear_fc2")
_CROSS_LINEARS = ("cross_attention.linear_q", "cross_attention.linear_kv", "cross_attention.linear_proj")
# multi-latent attention's linears (Megatron Core's MLA local spec keeps its norms unfolded: input_layernorm,
# q_layernorm, kv_layernorm, pre_mlp_layernorm; no sharded_state_dict_keys_map as the plain attention's spec has)
_MLA_LINEARS = ("self_attention.linear_q_proj", "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
                "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj")
_MLA_MARK = "self_attention.linear_kv_down_proj.weight"
# MoE experts: [layers, E, out, in] under Megatron Core's SequentialMLP torch_dist name
_CORE_EXPERTS = {f"mlp.experts.experts.linear_fc{w}.weight": ours for w, ours in OUR_EXPERTS.items()}
_MTP_LAYER = ".transformer_layer."
# "module:qualname" -> where the class lives here, of everything a .metadata written by torch.distributed.checkpoint
# (torch 2.x, Megatron Core's torch_dist strategy included) holds besides plain containers and torch's dtypes
DCP_METADATA_GLOBALS: Dict[str, str] = {
    **{f"{_DCP}metadata:{n}": f"{_DCP}metadata:{n}" for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    **{f"{_DCP}planner:{n}": f"{_DCP}planner:{n}" for n in (
        "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType", "TensorWriteData",
        "BytesIOWriteData")},
    **{f"{_DCP}filesystem:{n}": f"{_DCP}filesystem:{n}" for n in ("_StorageInfo", "_StoragePrefix")},
    # megatron-core <= 0.15 saved its Metadata/SavePlan subclasses (an extra ``mcore_data`` dict): torch's records
    "megatron.core.dist_checkpointing.strategies.torch:MCoreMetadata": f"{_DCP}metadata:Metadata",
    "megatron.core.dist_checkpointing.strategies.torch:MCoreSavePlan": f"{_DCP}planner:SavePlan",
    "torch:Size": "torch:Size",
    "torch.serialization:_get_layout": "torch.serialization:_get_layout",
    "collections:OrderedDict": "collections:OrderedDict",
    # the writer's checkpoint_id (Python 3.13 pickles pathlib's classes from pathlib._local); never a concrete path
    # of the other OS (it cannot be built here)
    **{f"{m}:{n}": f"pathlib:{n}" for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "PurePosixPath",
                                                                                  "PureWindowsPath")},
    **{f"{m}:WindowsPath": "pathlib:PureWindowsPath" for m in ("pathlib", "pathlib._local")},
}


def is_torch_dist(iter_dir: str) -> bool:
    """Whether `iter_dir` holds a torch_dist checkpoint (its metadata.json says so)."""
    path = os.path.join(iter_dir, METADATA_JSON)
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def is_dist_folder(iter_dir: str) -> bool:
    """Whether `iter_dir` holds Megatron-LM's distributed-checkpoint marker ``metadata.json`` (readable or not): a
    torch_dist folder, or a damaged one (`check_torch_dist` says which)."""
    return os.path.isfile(os.path.join(iter_dir, METADATA_JSON))


def check_torch_dist(iter_dir: str) -> None:
    """One-line ConversionError naming ``<iter_dir>/metadata.json`` when it is not the JSON object of a torch_dist
    folder (truncated, invalid, or another ``sharded_backend``)."""
    path = os.path.join(iter_dir, METADATA_JSON)
    try:
        with open(path, encoding="utf-8") as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise ConversionError(f"{path} is damaged ({detail}): a torch_dist checkpoint's metadata.json holds "
                              '{"sharded_backend": "torch_dist", ...}; restore the file (or the folder)') from None
    if backend != "torch_dist":
        raise ConversionError(f"{path} names sharded_backend {backend!r}: only torch_dist distributed checkpoints "
                              "are read here; save it from Megatron-LM with --ckpt-format torch_dist")


@functools.lru_cache(maxsize=1)
def dcp_metadata_allowed() -> Dict[str, Any]:
    """`DCP_METADATA_GLOBALS` resolved (each a class or function; never a module), plus ``torch:<name>`` of every
    torch dtype."""
    allowed: Dict[str, Any] = {}
    for name, target in DCP_METADATA_GLOBALS.items():
        module, _, qualname = target.partition(":")
        allowed[name] = getattr(importlib.import_module(module), qualname)
    allowed.update({f"torch:{n}": v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


def read_dcp_metadata(iter_dir: str, trust: bool = False) -> Any:
    """The folder's ``.metadata`` (torch.distributed.checkpoint's Metadata) through the restricted unpickler: a file
    that names anything off `DCP_METADATA_GLOBALS` is refused in one line (UnsafeCheckpointError) unless `trust`."""
    path = os.path.join(iter_dir, DCP_METADATA)
    if not os.path.isfile(path):
        raise ConversionError(f"torch_dist checkpoint {iter_dir} has no {DCP_METADATA}; the checkpoint is incomplete")
    try:
        with open(path, "rb") as f:
            return restricted_pickle_load(f, dcp_metadata_allowed(), path, trust=trust or None)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged or foreign file
        raise ConversionError(f"{path} is damaged or not torch.distributed.checkpoint metadata "
                              f"({str(exc).splitlines()[0][:160]})") from None


def read_common(iter_dir: str, trust: bool = False) -> Dict[str, Any]:
    """common.pt through the safe loader (weights-only + allow-list)."""
    path = os.path.join(iter_dir, COMMON)
    if not os.path.isfile(path):
        raise ConversionError(f"torch_dist checkpoint {iter_dir} has no {COMMON}; the checkpoint is incomplete")
    sd = safe_torch_load(path, map_location="cpu", trust=trust)
    if not isinstance(sd, dict):
        raise ConversionError(f"{path} is not a Megatron common state (a {type(sd).__name__}, not a dict)")
    return sd


def read_tensors(iter_dir: str, prefix: Optional[str] = None, trust: bool = False) -> Dict[str, torch.Tensor]:
    """{Core name: global tensor} of every tensor in the folder (byte entries skipped, never unpickled); with `prefix`
    only those whose names start with it, without it none of Megatron Core's bucket-space optimizer buffers."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    md = read_dcp_metadata(iter_dir, trust)
    files: Dict[str, int] = {}
    for info in md.storage_data.values():  # every data file named, and long enough for its byte ranges
        files[info.relative_path] = max(files.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(files.items()):
        path = os.path.join(iter_dir, rel)
        if not os.path.isfile(path):
            raise ConversionError(f"missing shard {path} of the torch_dist checkpoint {iter_dir}; restore it")
        if os.path.getsize(path) < end:
            raise ConversionError(f"shard {path} is truncated ({os.path.getsize(path)} bytes, the metadata needs "
                                  f"{end}); restore it")
    out: Dict[str, torch.Tensor] = {}
    handles: Dict[str, Any] = {}
    try:
        for key, item in md.state_dict_metadata.items():
            if not isinstance(item, TensorStorageMetadata) or (
                    not key.startswith(prefix) if prefix else key.startswith("optimizer.distributed.")):
                continue
            full = torch.empty(item.size, dtype=item.properties.dtype)
            for index, chunk in enumerate(item.chunks):
                info = md.storage_data[MetadataIndex(key, chunk.offsets, index)]
                path = os.path.join(iter_dir, info.relative_path)
                if getattr(info, "transform_descriptors", None):
                    raise ConversionError(f"{path}: {key} is stored with transforms {info.transform_descriptors} "
                                          "(compression?) that this reader does not apply")
                f = handles.setdefault(path, open(path, "rb"))  # noqa: SIM115 - closed below
                f.seek(info.offset)
                try:
                    part = torch.load(io.BytesIO(f.read(info.length)), map_location="cpu", weights_only=True)
                except Exception as exc:  # noqa: BLE001 - a damaged byte range
                    raise ConversionError(f"shard {path} is damaged (reading {key}: "
                                          f"{str(exc).splitlines()[0][:120]}); restore it") from None
                if not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(chunk.sizes):
                    raise ConversionError(f"shard {path} is damaged ({key} chunk has the wrong shape); restore it")
                full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = part
            out[key] = full
    finally:
        for f in handles.values():
            f.close()
    return out


def read_objects(iter_dir: str, prefix: str, trust: bool = False, shards: bool = False) -> Dict[str, Any]:
    """{name (``/shard_...`` cut off unless `shards`): value} of the folder's non-tensor entries (Megatron Core's
    ShardedObjects) whose names start with `prefix`, each through the safe loader (weights-only + allow-list)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = read_dcp_metadata(iter_dir, trust)
    out: Dict[str, Any] = {}
    for index, info in md.storage_data.items():
        key = index.fqn
        if not key.startswith(prefix) or not isinstance(md.state_dict_metadata.get(key), BytesStorageMetadata):
            continue
        path = os.path.join(iter_dir, info.relative_path)
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                data = io.BytesIO(f.read(info.length))
            data.name = f"{path} ({key})"
            value = safe_torch_load(data, map_location="cpu", trust=trust)
        except FileNotFoundError:
            raise ConversionError(f"missing shard {path} of the torch_dist checkpoint {iter_dir}; restore it") from None
        except MegatronUserError as exc:  # a damaged byte range, or a class off the allow-list (named)
            raise ConversionError(str(exc)) from None
        # a ShardedObject's payload is a one-element list
        out[key if shards else key.split("/shard_")[0]] = value[0] if isinstance(value, list) and len(value) == 1 \
            else value
    return out


def read_core_rng(iter_dir: str, trust: bool = False) -> Optional[Dict[str, Any]]:
    """Megatron-LM's RNG state in a torch_dist folder (ShardedObjects ``rng_state/shard_{pp}.{tp}[.{dp}]_{PP}.{TP}
    [.{DP}]``, each the list of RNG dicts its --ckpt-format torch files hold) as ``{"tp", "pp", "ranks": {(tp rank, pp
    rank): list}}`` (with the DP axis, written under expert parallelism, one entry per DP rank); None without one."""
    found = read_objects(iter_dir, "rng_state/", trust, shards=True)
    if not found:
        return None
    ranks: Dict[Tuple[int, int], Any] = {}
    shape: Tuple[int, ...] = ()
    for key, value in found.items():
        offsets, _, sizes = key.split("/shard_", 1)[1].partition("_")
        at, shape = tuple(int(x) for x in offsets.split(".")), tuple(int(x) for x in sizes.split("."))
        if len(at) == 2:
            ranks[(at[1], at[0])] = value
        else:
            ranks.setdefault((at[1], at[0]), {})[at[2]] = value[0] if isinstance(value, list) else value
    ranks = {k: [v[d] for d in sorted(v)] if isinstance(v, dict) else v for k, v in ranks.items()}
    if len(ranks) != shape[0] * shape[1]:
        raise ConversionError(f"{iter_dir}: its RNG state covers {len(ranks)} of {shape[0]} x {shape[1]} "
                              "model-parallel ranks; restore the checkpoint or pass --no-load-rng")
    return {"tp": shape[1], "pp": shape[0], "ranks": ranks}


def core_rng_objects(rng: Dict[str, Any], dp_axis: bool = False) -> Dict[str, Any]:
    """Megatron-LM 0.16's RNG ShardedObjects (training/checkpointing.py get_rng_state with torch_dist) of
    ``{"tp", "pp", "ranks": {(tp rank, pp rank): RNG list}}`` (each rank's list of RNG dicts, one per data-parallel
    rank, as its torch file holds it): ``rng_state/shard_{pp}.{tp}_{PP}.{TP}`` holding that list, or with `dp_axis`
    (written under expert parallelism) ``rng_state/shard_{pp}.{tp}.{dp}_{PP}.{TP}.{DP}`` holding one DP rank's
    ``[dict]``; each value the ShardedObject payload ``[data]``. The tracker's streams are written as Megatron Core
    keeps them, one generator-state tensor per name (the CUDA one when the run had CUDA)."""
    tp, pp = int(rng["tp"]), int(rng["pp"])
    out: Dict[str, Any] = {}
    for (t, p), states in rng["ranks"].items():
        states = [_core_rng_dict(s) for s in (states if isinstance(states, list) else [states])]
        if dp_axis:
            for d, one in enumerate(states):
                out[f"rng_state/shard_{p}.{t}.{d}_{pp}.{tp}.{len(states)}"] = [[one]]
        else:
            out[f"rng_state/shard_{p}.{t}_{pp}.{tp}"] = [states]
    return out


def _core_rng_dict(state: Dict[str, Any]) -> Dict[str, Any]:
    """One RNG dict with its tracker streams as Megatron Core's tracker holds them (a tensor per name; ours keeps
    {"cpu", "cuda"} and reads either form)."""
    streams = state.get("rng_tracker_states") or {}
    core = {name: (s.get("cuda") if s.get("cuda") is not None else s.get("cpu")) if isinstance(s, dict) else s
            for name, s in streams.items()}
    return {**state, "rng_tracker_states": core}


def core_stacked_to_ours(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """torch_dist's stacked Core tensors -> our full flat TP=1 state dict (one entry per layer)."""
    flat: Dict[str, torch.Tensor] = {}
    rest: Dict[str, torch.Tensor] = {}
    t5 = is_core_t5(tensors)
    for key, t in tensors.items():
        if t5 and key.startswith(("encoder.layers.", "decoder.layers.")):  # both stacks, renamed by mcore_names
            stack, _, suffix = key.partition("layers.")
            if not suffix.endswith("_extra_state"):
                rest.update({f"{stack}layers.{i}.{suffix}": t[i].clone() for i in range(t.size(0))})
            continue
        if key.startswith("encoder.layers."):  # BERT: per-layer Core names, renamed with the rest (mcore_names.py)
            suffix = key[len("encoder.layers."):]
            if not suffix.endswith("_extra_state"):
                rest.update({f"encoder.layers.{i}.{suffix}": t[i].clone() for i in range(t.size(0))})
            continue
        head, _, own = key.partition(_MTP_LAYER)
        if key.startswith(MTP_LAYERS) and own in _CORE_EXPERTS:  # an MTP depth's experts [E, out, in]
            flat[f"{head}{_MTP_LAYER}{_CORE_EXPERTS[own]}"] = experts_to_ours(t)
            continue
        if key.startswith("decoder.layers."):
            suffix = key[len("decoder.layers."):]
            if suffix.endswith("_extra_state"):
                continue
            index, _, own = suffix.partition(".")
            if index.isdigit():  # Megatron Core's non-homogeneous layers (--moe-layer-freq other than 1): per layer
                name = _CORE_EXPERTS.get(own) or core_layer_suffix_to_ours(own, key)
                flat[f"{_LAYERS}{index}.{name}"] = experts_to_ours(t) if own in _CORE_EXPERTS else t
                continue
            if suffix in _CORE_EXPERTS:
                for i in range(t.size(0)):
                    flat[f"{_LAYERS}{i}.{_CORE_EXPERTS[suffix]}"] = experts_to_ours(t[i])
                continue
            ours = core_layer_suffix_to_ours(suffix, key)
            for i in range(t.size(0)):
                flat[f"{_LAYERS}{i}.{ours}"] = t[i].clone()
        else:
            rest[key] = t
    flat.update(core_to_ours(rest))
    return mla_output_names(flat)  # per-layer (non-homogeneous) MLA layers: their output projection's name too


def ours_to_core_stacked(flat: Dict[str, torch.Tensor], num_layers: int) -> Dict[str, torch.Tensor]:
    """Our full flat TP=1 state dict -> torch_dist's tensors (layers stacked; norms in Transformer Engine's names)."""
    if is_our_t5(flat):
        return _t5_stacked(flat)
    stack = "encoder.layers." if is_our_bert(flat) else "decoder.layers."
    per_suffix: Dict[str, list] = {}
    rest: Dict[str, torch.Tensor] = {}
    for key, t in flat.items():
        if key.startswith(_LAYERS):
            index, _, suffix = key[len(_LAYERS):].partition(".")
            per_suffix.setdefault(suffix, [None] * num_layers)[int(index)] = t
        else:
            rest[key] = t
    # norms folded into the next linear as Transformer Engine's spec names them (and Core's local spec maps its
    # names to), except with multi-latent attention, whose local spec does not: unfolded, as Core reads them
    fused = _MLA_MARK not in per_suffix
    core_experts = {ours: core for core, ours in _CORE_EXPERTS.items()}
    mtp = {k: rest.pop(k) for k in [k for k in rest if k.startswith(MTP_LAYERS)]}
    out = ours_to_core(rest)
    for key, t in mtp.items():  # an MTP depth's transformer layer: a decoder layer's names, its experts stacked
        head, _, suffix = key.partition(_MTP_LAYER)
        if not suffix:
            out[key] = t
        elif suffix in core_experts:
            out[f"{head}{_MTP_LAYER}{core_experts[suffix]}"] = experts_to_core(t)
        else:
            out[f"{head}{_MTP_LAYER}{our_layer_suffix_to_core(suffix, fused_norms=fused)}"] = t
    # layers of different kinds (MoE and dense: --moe-layer-freq other than 1) are not stacked: each layer under its
    # own names, as Megatron Core's non-homogeneous layers (``decoder.layers.{i}.*``; experts [E, out, in])
    mixed = stack == "decoder.layers." and any(t is None for ts in per_suffix.values() for t in ts)
    for suffix, tensors in per_suffix.items():
        if mixed:
            name = core_experts.get(suffix) or our_layer_suffix_to_core(suffix, fused_norms=fused)
            out.update({f"{stack}{i}.{name}": experts_to_core(t) if suffix in core_experts else t
                        for i, t in enumerate(tensors) if t is not None})
            continue
        if any(t is None for t in tensors):
            raise ConversionError(f"layer tensor {suffix} is missing for some of the {num_layers} layers (torch_dist "
                                  "stacks the layers of a model whose layers are alike: every layer must have it)")
        if suffix in core_experts:
            out[stack + core_experts[suffix]] = torch.stack([experts_to_core(t) for t in tensors])
            continue
        out[stack + our_layer_suffix_to_core(suffix, fused_norms=fused)] = torch.stack(tensors)
    return out


def _t5_stacked(flat: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Our full flat T5 state dict -> torch_dist's tensors (each stack's layers stacked on a leading axis)."""
    per: Dict[str, Dict[int, torch.Tensor]] = {}
    out: Dict[str, torch.Tensor] = {}
    for key, t in ours_to_core(flat, fused_norms=True).items():
        stack, _, rest = key.partition("layers.")
        if stack in ("encoder.", "decoder.") and rest:
            index, _, suffix = rest.partition(".")
            per.setdefault(f"{stack}layers.{suffix}", {})[int(index)] = t
        else:
            out[key] = t
    for key, layers in per.items():
        if sorted(layers) != list(range(len(layers))):
            raise ConversionError(f"T5 layer tensor {key} is missing for some layers (torch_dist stacks layers)")
        out[key] = torch.stack([layers[i] for i in range(len(layers))])
    return out


def _architecture(common: Dict[str, Any], tensors: Dict[str, torch.Tensor], path: str,
                  flags: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The checkpoint's architecture (stored, or from its args); a Core checkpoint without either (Megatron-LM loads
    those with its command-line flags) takes `flags`, this run's architecture, when given."""
    arch = saved_architecture(common.get("architecture"), common.get("args"))
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if not arch.get(k)]
    from_flags = bool(missing) and flags is not None
    if from_flags:
        arch = dict(flags)
    elif missing:
        raise ConversionError(f"{path} records neither 'architecture' nor args with {', '.join(missing)}: "
                              f"{NO_ARGS_HINT}")
    qkv = tensors.get("decoder.layers.self_attention.linear_qkv.weight")
    field = "decoder_num_layers" if is_core_t5(tensors) and arch.get("decoder_num_layers") else "num_layers"
    if qkv is not None and qkv.size(0) != arch[field]:
        if from_flags:
            raise ConversionError(f"{path} records no args and its tensors stack {qkv.size(0)} layers but the flags "
                                  f"give {field}={arch[field]}: pass --{field.replace('_', '-')} {qkv.size(0)}")
        raise ConversionError(f"{path}: the tensors stack {qkv.size(0)} layers but the args say {field}="
                              f"{arch[field]}: mismatched files")
    if "output_layer.weight" in tensors:
        arch["share_embeddings_and_output_weights"] = False
    arch["padded_vocab_size"] = int(tensors["embedding.word_embeddings.weight"].size(0))
    return arch


def read_iteration_state(iter_dir: str, trust: bool = False, flags: Optional[Dict[str, Any]] = None
                         ) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """(common state, architecture, our full flat TP=1 state dict, {optimizer state key: our full flat dict}) of one
    torch_dist iteration folder (the last empty without model-space optimizer state: torch_dist_optim.py); `flags`:
    this run's architecture, taken when the folder records none (`_architecture`)."""
    common = read_common(iter_dir, trust)
    tensors, opt = split_optimizer_tensors(read_tensors(iter_dir, trust=trust))
    if "embedding.word_embeddings.weight" not in tensors:
        raise ConversionError(f"torch_dist checkpoint {iter_dir} has no embedding.word_embeddings.weight: not a GPT "
                              "model checkpoint")
    arch = _architecture(common, tensors, os.path.join(iter_dir, COMMON), flags)
    flat = core_stacked_to_ours(tensors)
    opt_flat = {k: core_stacked_to_ours(v) for k, v in opt.items()}
    if sharding_type(common) == BUCKETS:  # Megatron-LM's default layout: rebuilt in model space when asked for
        common = dict(common, optimizer=dict(common["optimizer"]))
        try:
            groups, opt_flat = bucket_state(read_tensors(iter_dir, "optimizer.distributed.", trust),
                                            read_objects(iter_dir, "optimizer.distributed.", trust), flat, arch,
                                            common.get("args"), iter_dir)
            common["optimizer"].update(groups)
        except ConversionError as exc:
            common["optimizer"][UNREADABLE] = str(exc)
    return common, arch, flat, opt_flat


def read_iteration(iter_dir: str, trust: bool = False) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
    """(common state, architecture, our full flat TP=1 state dict) of one torch_dist iteration folder."""
    common, arch, flat, _ = read_iteration_state(iter_dir, trust)
    return common, arch, flat


def model_type_of(flat: Dict[str, Any]) -> str:
    """The model type of our full flat state dict: the family whose own modules it holds (a decoder stack: T5;
    BERT's heads: BERT; megatron/models/registry.py), else GPT."""
    return registry.layout_holding(flat).model_type


def read_torch_dist(load_dir: str, trust: bool = False, iteration: Optional[int] = None, optimizer: bool = False,
                    model_type: str = "GPT") -> Tuple[ModelMeta, Iterator[Message]]:
    """Loader: (meta, message stream) of a torch_dist checkpoint of a `model_type` model (the tracker's iteration, or
    `iteration`); with `optimizer` the messages carry its model-space optimizer state (torch_dist_optim.py) when it
    has one (GPT, BERT and T5)."""
    iter_dir, it = find_iteration_dir(load_dir, iteration)
    # checked against its manifest as --load does (the newest intact iteration; an explicit one must verify)
    iter_dir, it, verified = verified_source(load_dir, iter_dir, it, explicit=iteration is not None)
    check_torch_dist(iter_dir)
    common, arch, flat, opt = read_iteration_state(iter_dir, trust)
    found = model_type_of(flat)
    if found != model_type:
        raise ConversionError(f"{iter_dir} holds a {found} model (Megatron Core names): pass --model-type {found}")
    args = common.get("args")
    saved = SavedRunArgs.from_args(args)
    meta = ModelMeta(model_type=model_type, architecture=arch, iteration=None if it is None else int(common.get(
        "iteration", it)), checkpoint_args=args, true_vocab_size=saved.true_vocab_size,
        consumed_train_samples=int(common.get("consumed_train_samples", saved.consumed_train_samples) or 0),
        consumed_valid_samples=int(common.get("consumed_valid_samples", saved.consumed_valid_samples) or 0),
        make_vocab_size_divisible_by=saved.make_vocab_size_divisible_by,
        tokenizer=saved.tokenizer_dict(), source=iter_dir, extra={"unverified_source": None if verified else iter_dir})
    family = registry.layout_for(model_type)
    if family.describe is not None:  # the family's own record (BERT's heads, T5's stacks) from the whole model
        meta.extra[family.extra_key] = family.describe(flat, flat)
    if family.encoder_decoder:  # each stack's layer count (its record), the encoder-decoder stream
        counts = list(meta.extra[family.extra_key].values())
        meta.extra["split_rank"] = None

        def stream(state: Dict[str, Any]) -> Iterator[Message]:
            return t5_messages_from_state_dict(state, *counts)
    else:
        def stream(state: Dict[str, Any]) -> Iterator[Message]:
            return messages_from_state_dict(state, arch["num_layers"])
    messages = stream(flat)
    if not optimizer or meta.iteration is None or not (opt or common.get("optimizer")):
        return meta, messages
    try:
        meta.extra["optimizer"] = optimizer_common(common, opt, iter_dir)
    except ConversionError as exc:
        print(f"note: {exc}: its optimizer state is not converted; writing the weights only", flush=True)
        return meta, messages
    meta.extra["opt_param_scheduler"] = common.get("opt_param_scheduler")
    meta.extra["source_padded_vocab_size"] = arch["padded_vocab_size"]
    return meta, _with_optimizer(messages, {k: stream(v) for k, v in opt.items()})


def _with_optimizer(messages: Iterator[Message], per_key: Dict[str, Iterator[Message]]) -> Iterator[Message]:
    """The model messages with their training state (`Message.optimizer`) from one message stream per state key."""
    for msg in messages:
        parts = {k: next(stream) for k, stream in per_key.items()}
        msg.optimizer = {name: {k: part.tensors[name] for k, part in parts.items() if name in part.tensors}
                         for name in msg.tensors if PARAM in parts and name in parts[PARAM].tensors}
        yield msg


def core_args(args: Any) -> Any:
    """`args` as Megatron-LM stores them in common.pt: ``model_type`` (our megatron.layers.enums member, or any other
    enum) becomes Megatron Core's ``megatron.core.enums.ModelType.encoder_or_decoder``, the class megatron-core's
    weights-only loader allow-lists (a copy; `args` itself is left as it is)."""
    model_type = vars(args).get("model_type")  # the saved namespace's own entry (data being written, not a flag read)
    if not isinstance(model_type, enum.Enum) or model_type is CORE_MODEL_TYPE:
        return args
    out = copy.copy(args)
    out.model_type = CORE_MODEL_TYPE
    return out


def _linears(tensors: Dict[str, torch.Tensor], moe: bool) -> Tuple[str, ...]:
    """A decoder layer's linears (each has a Megatron Core extra-state object): multi-latent attention's when the
    model has it, the MLP's or the MoE layer's shared expert's."""
    plain = _MOE_LINEARS if moe else _LINEARS
    if not any(k.endswith(_MLA_MARK) for k in tensors):
        return plain
    mla = tuple(n for n in _MLA_LINEARS if any(k.endswith(f"{n}.weight") for k in tensors))
    return mla + plain[1:]


def _mtp_objects(tensors: Dict[str, torch.Tensor], experts: int) -> Dict[str, Any]:
    """The extra-state objects of each MTP depth (Megatron Core's ``mtp.layers.D``): its eh_proj and its transformer
    layer's linears (and experts), one shard each as a non-stacked layer."""
    out: Dict[str, Any] = {}
    for head in sorted({MTP_LAYERS + k[len(MTP_LAYERS):].partition(".")[0] for k in tensors
                        if k.startswith(MTP_LAYERS)}):
        moe = f"{head}{_MTP_LAYER}mlp.router.weight" in tensors
        names = [f"{head}.eh_proj", *(f"{head}{_MTP_LAYER}{n}" for n in _linears(tensors, moe))]
        out.update({f"{n}._extra_state/shard_0_1": [None] for n in names})
        for w in ("1", "2") if moe else ():
            for e in range(experts):
                out[f"{head}{_MTP_LAYER}mlp.experts.experts.linear_fc{w}._extra_state/shard_{e}_{experts}"] = [None]
    return out


def write_torch_dist(meta: ModelMeta, messages: Iterator[Message], iter_dir: str,
                     extra_common: Optional[Dict[str, Any]] = None, rng: Optional[Dict[str, Any]] = None,
                     rng_dp_axis: bool = False) -> None:
    """Write one torch_dist iteration folder from a message stream (into a temporary folder, renamed at the end).
    Messages with training state (`Message.optimizer`, `meta.extra["optimizer"]`) add the optimizer state in Megatron
    Core's fully_reshardable layout (torch_dist_optim.py); `rng` (``{"tp", "pp", "ranks"}``) adds Megatron-LM's
    ``rng_state`` ShardedObjects (core_rng_objects)."""
    msgs = list(messages)
    num_layers = int(meta.architecture["num_layers"])
    family = registry.layout_for(meta.model_type)
    from_messages = t5_state_dict_from_messages if family.encoder_decoder else state_dict_from_messages
    flat = from_messages(iter(msgs))
    tensors = {k: v.detach().contiguous().clone() for k, v in ours_to_core_stacked(flat, num_layers).items()}
    state: Dict[str, Any] = dict(tensors)
    opt_common = meta.extra.get("optimizer")
    if opt_common and any(m.optimizer for m in msgs):
        for key in [PARAM, *opt_common.get("state_keys", [])]:
            per_key = from_messages(Message(m.name, {n: e[key] for n, e in m.optimizer.items() if key in e})
                                    for m in msgs)  # (Muon: momentum_buffer for its matrices, moments for the rest)
            state.update(state_tensors({key: ours_to_core_stacked(per_key, num_layers)}))
    experts = int(meta.architecture.get("num_moe_experts") or 0)
    mixed = any(k.startswith("decoder.layers.") and k.split(".")[2].isdigit() for k in tensors)
    stacks = [] if mixed else [(family.core_stack, _linears(tensors, experts > 0), num_layers)]
    if family.encoder_decoder:  # both stacks; the decoder's cross-attention linears too
        own = meta.extra[family.extra_key]
        enc, dec = own["encoder_num_layers"], own["decoder_num_layers"]
        stacks = [("encoder.layers.", _LINEARS, enc), ("decoder.layers.", _LINEARS + _CROSS_LINEARS, dec)]
    for prefix, linears, count in stacks:  # Megatron Core's per-layer ShardedObjects (empty extra state), so its
        for linear in linears:             # loader finds them
            for i in range(count):
                # DCP's default planner torch.saves the value: Megatron Core's ShardedObject payload, a list of data
                state[f"{prefix}{linear}._extra_state/shard_{i}_{count}"] = [None]
    for name in family.core_head_objects:  # the LM head's output layer (the bias; the weight tied), T5's twice
        state[f"{name}._extra_state/shard_0_1"] = [None]
    for i in range(num_layers) if mixed else ():  # non-homogeneous layers: each layer's own objects
        moe = f"decoder.layers.{i}.mlp.router.weight" in tensors
        for linear in _linears(tensors, moe):
            state[f"decoder.layers.{i}.{linear}._extra_state/shard_0_1"] = [None]
        for w in ("1", "2") if moe else ():
            for e in range(experts):
                state[f"decoder.layers.{i}.mlp.experts.experts.linear_fc{w}._extra_state/shard_{e}_{experts}"] = [None]
    for w in ("1", "2") if experts and not mixed else ():  # per (layer, expert)
        for i in range(num_layers):
            for e in range(experts):
                state[f"decoder.layers.mlp.experts.experts.linear_fc{w}._extra_state/shard_{i}.{e}_{num_layers}."
                      f"{experts}"] = [None]
    state.update(_mtp_objects(tensors, experts))
    if rng is not None:
        state.update(core_rng_objects(rng, rng_dp_axis))
    args = core_args(meta.checkpoint_args if meta.checkpoint_args is not None else args_namespace(meta))
    common = {"args": args, "checkpoint_version": 3.0, "iteration": meta.iteration or 0,
              "architecture": dict(meta.architecture), **(extra_common or {})}
    if opt_common and any(m.optimizer for m in msgs):
        common["optimizer"] = common_entry(opt_common)
        if meta.extra.get("opt_param_scheduler") is not None:
            common.setdefault("opt_param_scheduler", meta.extra["opt_param_scheduler"])
    _publish_dist_folder(state, common, iter_dir)


def _publish_dist_folder(state: Dict[str, Any], common: Dict[str, Any], iter_dir: str) -> None:
    """Write `state` (DCP shards + .metadata), common.pt and metadata.json into `iter_dir`.tmp, then rename it to
    `iter_dir`. A failed write removes the temporary folder; a full disk is one line (`DiskFullError`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    tmp = iter_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        # the keys are already flat: nested payloads (the RNG dicts) stay one pickled object each, as Megatron Core's
        with warnings.catch_warnings():  # the single-process save is the intent; torch warns about it anyway
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True,
                     planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
        atomic_torch_save(common, os.path.join(tmp, COMMON))
        atomic_write_text(os.path.join(tmp, METADATA_JSON), json.dumps(
            {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
             "common_backend_version": 1}))
    except (OSError, RuntimeError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        folder = os.path.dirname(iter_dir.rstrip("/")) or "."
        if is_disk_full(exc, folder):
            raise DiskFullError(f"no space left on the device holding {folder} while writing the torch_dist folder "
                                f"{os.path.basename(iter_dir.rstrip('/'))} ({tensor_bytes(state) / 2**20:.1f} MiB of "
                                "tensors): free space or write somewhere else; the previous checkpoint is "
                                "intact") from None
        raise
    shutil.rmtree(iter_dir, ignore_errors=True)
    os.replace(tmp, iter_dir)
