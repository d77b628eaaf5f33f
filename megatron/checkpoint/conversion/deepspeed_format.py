"""DeepSpeed checkpoints (``latest``, ``global_stepN/``) read as a stream of the interchange form, one layer at a time.

`DeepSpeedCheckpointReader` presents a DeepSpeed tag folder with the interface of megatron_format's
`MegatronCheckpointReader` (``chunks[(tp, pp, vp)]`` = flat GPTModel names, ``merged``), so the same layer-by-layer
stream (QKV order, TP merge with the parameters' own layouts, vocabulary rows) serves both formats:

- non-pipeline engine, ZeRO 0/1/2 (and ``--to-deepspeed`` output): ``mp_rank_{tp:02d}_model_states.pt`` whose
  ``module`` is tensor rank tp's GPTModel state dict, opened memory-mapped;
- pipeline engine (GPTModelPipe): ``layer_{idx:02d}-model_{tp:02d}-model_states.pt``, one file per pipe layer,
  memory-mapped and renamed to Megatron's names (global layer numbers, one chunk per tensor rank); both our
  GPTModelPipe's numbering (embedding layer_00, transformer layers 01..L, final norm L+1) and Megatron-DeepSpeed's,
  in which BigScience wrote BLOOM (embedding layer_01, transformer layers 03..L+2, final norm L+4: its spec list
  also holds parameter-free functions), recognised by which of layer_00 / layer_01 exists;
- ZeRO-3: the weights live in the fp32 optimizer partitions; each tensor rank is consolidated with DeepSpeed's
  ``zero_to_fp32`` (that one holds a tensor rank in memory: DeepSpeed's format has no per-layer access).

The client state of model rank 0 (``args``, ``iteration``, consumed samples, ``opt_param_scheduler``) becomes the
`ModelMeta` as for a Megatron checkpoint.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.checkpoint.conversion.interchange import ConversionError, Message, ModelMeta
from megatron.checkpoint.conversion.megatron_format import (
    WORD,
    MegatronCheckpointReader,
    architecture_from,
    load_checkpoint_file,
    megatron_meta,
    stream_messages,
)
from megatron.core.tensor_parallel.layout import TensorParallelLayout
from megatron.run_configs.saved_args import SavedRunArgs

LATEST = "latest"
MP_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


def bigscience_index(idx: int, num_layers: int) -> int:
    """Our GPTModelPipe layer index -> Megatron-DeepSpeed's (BigScience's BLOOM files): 0 -> 1, transformer layer
    k (1..L) -> k + 2, final norm L+1 -> L+4, untied output layer L+2 -> L+5."""
    if idx == 0:
        return 1
    return idx + 2 if idx <= num_layers else idx + 3


def from_bigscience_index(idx: int, num_layers: int) -> int:
    """Inverse of `bigscience_index` (ValueError for an index that holds no parameters there)."""
    if idx == 1:
        return 0
    if 3 <= idx <= num_layers + 2:
        return idx - 2
    if idx in (num_layers + 4, num_layers + 5):
        return idx - 3
    raise ValueError(f"layer_{idx:02d} is not a parameter layer of a {num_layers}-layer Megatron-DeepSpeed "
                     "GPTModelPipe (embedding 01, transformer layers 03.., final norm L+4)")


def resolve_tag_dir(load_dir: str, iteration: Optional[int] = None) -> str:
    """The ``global_stepN`` folder: --iteration N, else the tag named by ``latest`` (or `load_dir` itself)."""
    if not os.path.isdir(load_dir):
        raise ConversionError(f"--load-dir {load_dir} does not exist")
    if iteration is None and any(n.endswith("_model_states.pt") for n in os.listdir(load_dir)):
        return load_dir  # pointed at global_stepN/ itself
    if iteration is not None:
        tag = f"global_step{iteration}"
    else:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            hint = " (it is a Megatron checkpoint: use --loader megatron)" if os.path.isfile(
                os.path.join(load_dir, "latest_checkpointed_iteration.txt")) else ""
            raise ConversionError(f"--load-dir {load_dir} is not a DeepSpeed checkpoint: no '{LATEST}' file{hint}")
        from megatron.checkpoint.integrity import read_pointer_file

        try:
            tag = read_pointer_file(latest)
        except ValueError as exc:
            raise ConversionError(str(exc)) from None
    tag_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(tag_dir):
        raise ConversionError(f"DeepSpeed checkpoint {tag_dir} does not exist; fix --iteration or the "
                              f"'{LATEST}' file")
    return tag_dir


def verified_tag_dir(load_dir: str, iteration: Optional[int] = None) -> Tuple[str, bool]:
    """(tag folder, verified): resolve_tag_dir checked against its manifest as --load does (megatron_format's
    verified_source: the newest intact global_stepN at or below 'latest''s; an explicit one must verify)."""
    from megatron.checkpoint.conversion.megatron_format import verified_source

    tag_dir = resolve_tag_dir(load_dir, iteration)
    m = re.fullmatch(r"global_step(\d+)", os.path.basename(os.path.normpath(tag_dir)))
    explicit = iteration is not None or os.path.normpath(tag_dir) == os.path.normpath(load_dir)
    if m is None:  # a custom tag: nothing to fall back to
        explicit = True
    tag_dir, _, verified = verified_source(os.path.dirname(os.path.normpath(tag_dir)), tag_dir,
                                           int(m.group(1)) if m else None, explicit, layout="deepspeed")
    return tag_dir, verified


def tag_layout(tag_dir: str) -> Tuple[str, Dict[Any, str]]:
    """('pipe' | 'module' | 'zero3', {rank key: file name}) of a tag folder (one-line error for anything else)."""
    names = sorted(os.listdir(tag_dir))
    layers = {(int(m.group(1)), int(m.group(2))): n for n in names for m in [LAYER_RE.match(n)] if m}
    if layers:
        return "pipe", layers
    mp = {int(m.group(1)): n for n in names for m in [MP_RE.match(n)] if m}
    if mp:
        return "module", mp
    zero3 = {(int(m.group(1)), int(m.group(2))): n for n in names for m in [ZERO3_RE.match(n)] if m}
    if zero3:
        return "zero3", zero3
    raise ConversionError(f"{tag_dir} is not a DeepSpeed checkpoint of a known layout (no mp_rank_XX_model_states.pt, "
                          "zero_pp_rank_X_mp_rank_XX_model_states.pt or layer_XX-model_XX-model_states.pt files)")


def zero3_rank_state(tag_dir: str, tp: int) -> Dict[str, torch.Tensor]:
    """One tensor rank of a ZeRO-3 checkpoint consolidated by DeepSpeed's zero_to_fp32 (fp32 master weights)."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise ConversionError(
            f"{tag_dir} is a ZeRO-3 checkpoint (weights live in the optimizer partitions) and DeepSpeed is not "
            "installed: run DeepSpeed's zero_to_fp32.py on it first, or install deepspeed") from None
    pattern = re.compile(rf"^zero_pp_rank_\d+_mp_rank_{tp:02d}_(model|optim)_states\.pt$")
    with tempfile.TemporaryDirectory() as tmp:
        tag = os.path.basename(os.path.normpath(tag_dir))
        view = os.path.join(tmp, tag)
        os.makedirs(view)
        for name in os.listdir(tag_dir):
            if pattern.match(name):
                os.symlink(os.path.abspath(os.path.join(tag_dir, name)), os.path.join(view, name))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                sd = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=tag)
            except (ValueError, FileNotFoundError) as exc:
                raise ConversionError(f"{tag_dir} (tensor rank {tp}): zero_to_fp32 failed: "
                                      f"{str(exc).splitlines()[0]}") from None
    return dict(sd)


class DeepSpeedCheckpointReader(MegatronCheckpointReader):
    """A DeepSpeed tag folder with MegatronCheckpointReader's interface (pp = vp = 1: one chunk per tensor rank)."""

    def __init__(self, tag_dir: str, trust: bool = False) -> None:  # noqa: D107 - no super().__init__: other files
        self.load_dir = self.iter_dir = tag_dir
        self.trust = trust
        self.layout, files = tag_layout(tag_dir)
        self.bigscience = False  # Megatron-DeepSpeed's pipe layer numbering (set below for a pipe layout)
        self.pp = self.vp = 1
        self.version = 3.0
        meta_name = {"module": lambda: files.get(0), "zero3": lambda: files.get((0, 0)),
                     "pipe": lambda: "mp_rank_00_model_states.pt"}[self.layout]()
        meta_path = os.path.join(tag_dir, meta_name or "mp_rank_00_model_states.pt")
        if not os.path.isfile(meta_path):
            raise ConversionError(f"{tag_dir} has no {os.path.basename(meta_path)} (the client state of model rank 0); "
                                  "the checkpoint is incomplete")
        self.first = load_checkpoint_file(meta_path, trust)
        args = self.first.get("args")
        self.version = float(self.first.get("checkpoint_version", 3.0) or 3.0)
        self.architecture = architecture_from(self.first, meta_path)
        self.chunks: Dict[Tuple[int, int, int], Dict[str, Any]] = {}
        self.files: Dict[Tuple[int, int], str] = {}
        self.optim_entries: Dict[Tuple[int, int], Any] = {}  # weights only: no training state is read from here
        self.opt: Optional[Dict[Any, Any]] = None
        self.opt_common: Dict[str, Any] = {}
        self.rng_states: Dict[int, Any] = {}  # client 'rng_state' per tensor rank (not in pipe-engine layouts)
        read = {"module": self._read_module_files, "zero3": self._read_zero3_files, "pipe": self._read_pipe_files}
        tps = read[self.layout](tag_dir, files, trust, args)
        self._check_shards(tag_dir, tps, args)
        m = re.search(r"(\d+)$", os.path.basename(os.path.normpath(tag_dir)))
        self.iteration = int(self.first.get("iteration", int(m.group(1)) if m else 0))

    def _read_module_files(self, tag_dir: str, files: Dict[Any, str], trust: bool, args: Any) -> List[int]:
        """Weights of a plain engine layout (one mp_rank_XX_model_states.pt per tensor rank); the tensor ranks."""
        from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict

        tps = sorted(files)
        for t in tps:
            path = os.path.join(tag_dir, files[t])
            state = self.first if t == 0 else load_checkpoint_file(path, trust)
            module = state.get("module")
            if not isinstance(module, dict):
                raise ConversionError(f"{path} holds no 'module' weights")
            if any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in module.values()):
                raise ConversionError(f"{path} holds ZeRO-3 placeholders and no optimizer partitions were found: "
                                      "run DeepSpeed's zero_to_fp32.py on the checkpoint first")
            self.chunks[(t, 0, 0)] = flatten_checkpoint_state_dict(module)
            self.files[(t, 0)] = path
            self.rng_states[t] = state.get("rng_state")
        return tps

    def _read_zero3_files(self, tag_dir: str, files: Dict[Any, str], trust: bool, args: Any) -> List[int]:
        """Weights of a ZeRO-3 layout, gathered from the optimizer partitions; the tensor ranks."""
        tps = sorted({t for _, t in files})
        for t in tps:
            self.chunks[(t, 0, 0)] = zero3_rank_state(tag_dir, t)
            self.files[(t, 0)] = os.path.join(tag_dir, files[(0, t)])
            self.rng_states[t] = (self.first if t == 0 else load_checkpoint_file(self.files[(t, 0)], trust)).get("rng_state")
        return tps

    def _read_pipe_files(self, tag_dir: str, files: Dict[Any, str], trust: bool, args: Any) -> List[int]:
        """Weights of a pipe-engine layout (layer_XX-model_YY files, BigScience numbering detected); the tensor ranks."""
        from megatron.models.gpt.model_pipe import megatron_state_dict_from_pipe_layers

        tps = sorted({t for _, t in files})
        indices = {idx for idx, _ in files}
        self.bigscience = 0 not in indices and 1 in indices
        num_layers = self.architecture.get("num_layers") or SavedRunArgs.from_args(args).num_layers
        if num_layers is None:  # no client state: count the files (final norm = last file)
            num_layers = max(indices) - (4 if self.bigscience else 1)
        for t in tps:
            layers = {idx: load_checkpoint_file(os.path.join(tag_dir, n), trust) for (idx, tt), n in sorted(files.items())
                      if tt == t}
            try:
                if self.bigscience:
                    layers = {from_bigscience_index(idx, num_layers): sd for idx, sd in layers.items()}
                self.chunks[(t, 0, 0)] = megatron_state_dict_from_pipe_layers(layers, num_layers)
            except ValueError as exc:
                raise ConversionError(f"{tag_dir} (tensor rank {t}): {exc}") from None
            self.files[(t, 0)] = os.path.join(tag_dir, files[min(k for k in files if k[1] == t)])
        return tps

    def _check_shards(self, tag_dir: str, tps: List[int], args: Any) -> None:
        """Tensor ranks 0..N-1 as the args say, the same parameters in each, the layers the args name; sets tp."""
        if tps != list(range(len(tps))):
            raise ConversionError(f"{tag_dir}: tensor ranks {tps} are not 0..{len(tps) - 1}; a file is missing")
        self.tp = len(tps)
        saved_tp = int(SavedRunArgs.from_args(args).tensor_model_parallel_size or self.tp)
        if saved_tp != self.tp:
            raise ConversionError(f"{tag_dir} holds {self.tp} tensor-parallel shards but its args say "
                                  f"--tensor-model-parallel-size {saved_tp}; the checkpoint is incomplete")
        for t in range(1, self.tp):
            if set(self.chunks[(t, 0, 0)]) != set(self.chunks[(0, 0, 0)]):
                raise ConversionError(f"{self.files[(t, 0)]} and {self.files[(0, 0)]} hold different parameters: "
                                      "mismatched shards")
        total = self._layers_in(0, 0)
        if self.architecture.get("num_layers") not in (None, total):
            raise ConversionError(f"{tag_dir} holds {total} layers but its args say num_layers="
                                  f"{self.architecture['num_layers']}: mismatched shards")
        self.architecture["num_layers"] = total


def read_deepspeed(load_dir: str, *, iteration: Optional[int] = None, true_vocab_size: Optional[int] = None,
                   model_type: str = "GPT", trust: bool = False, optimizer: bool = False
                   ) -> Tuple[ModelMeta, Iterator[Message]]:
    """Loader: (meta, message stream) of a DeepSpeed GPT checkpoint (any ZeRO stage, pipeline engine, any TP); with
    `optimizer`, a ZeRO 1/2 non-pipeline checkpoint's optimizer state travels too (optimizer_state.zero_entries)."""
    if model_type != "GPT":
        raise ConversionError(f"--loader deepspeed reads GPT checkpoints (--model-type {model_type} is not supported)")
    tag_dir, verified = verified_tag_dir(load_dir, iteration)
    reader = DeepSpeedCheckpointReader(tag_dir, trust)
    reader.verified = verified
    meta = megatron_meta(reader, true_vocab_size, model_type)
    meta.source = load_dir
    if WORD not in reader.chunks[(0, 0, 0)]:
        raise ConversionError(f"{reader.files[(0, 0)]} has no {WORD}: not a GPT checkpoint")
    padded = reader.merged(0, 0, WORD, TensorParallelLayout(dim=0)).size(0)
    meta.architecture["padded_vocab_size"] = padded
    if meta.true_vocab_size is not None and meta.true_vocab_size > padded:
        raise ConversionError(f"--true-vocab-size {meta.true_vocab_size} exceeds the checkpoint's {padded} "
                              "vocabulary rows")
    meta.extra["layout"] = reader.layout
    if reader.rng_states and all(r is not None for r in reader.rng_states.values()):
        meta.extra["rng_states"] = reader.rng_states  # kept by write_megatron when the layout is unchanged
    if optimizer and reader.layout == "module":
        from megatron.checkpoint.conversion.optimizer_state import ForeignOptimizerState, attach_zero_state

        try:
            attach_zero_state(reader, lambda path: load_checkpoint_file(path, trust))
        except ForeignOptimizerState as exc:
            print(f"note: {exc}: its optimizer state is not converted; writing the weights only", flush=True)
            reader.opt = None
        if reader.opt is not None:
            meta.extra.update(optimizer=reader.opt_common, source_padded_vocab_size=padded)
            if reader.first.get("consumed_train_tokens") is not None:
                meta.extra["consumed_tokens"] = (int(reader.first["consumed_train_tokens"]),
                                                 int(reader.first.get("consumed_valid_tokens", 0) or 0))
    elif optimizer:
        print(f"note: the optimizer state of a DeepSpeed {reader.layout} checkpoint is not converted (ZeRO 1/2 "
              "without the pipeline engine is); writing the weights only", flush=True)
    if reader.layout == "pipe" and reader.bigscience:
        meta.extra["bigscience"] = True
    if reader.layout == "pipe":  # the source's pipeline size (the stream itself is layout-free)
        meta.extra["pp"] = int(getattr(meta.checkpoint_args, "pipeline_model_parallel_size", 1) or 1)
    return meta, stream_messages(reader, meta)


# ----------------------------------------------------------------------------------------------- writing
def engine_state(iteration: int, samples: int, tp: int, pp: int) -> Dict[str, Any]:
    """The engine fields DeepSpeed's load_checkpoint reads from ``mp_rank_XX_model_states.pt`` (no optimizer)."""
    import importlib.metadata

    try:
        ds_version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds_version = "0.0.0"
    return {"buffer_names": [], "optimizer": None, "lr_scheduler": None, "skipped_steps": 0,
            "global_steps": iteration, "global_samples": samples, "dp_world_size": 1, "mp_world_size": tp * pp,
            "ds_version": ds_version, "param_shapes": None, "frozen_param_shapes": None, "shared_params": {},
            "frozen_param_fragments": None, "data_sampler": None, "random_ltd": None,
            "checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": tp}}


def write_deepspeed(meta: ModelMeta, messages: Iterator[Message], save_dir: str, tp: int = 1,
                    pp: int = 1, bigscience: bool = False) -> Dict[str, Any]:
    """Saver: the stream as DeepSpeed ``global_stepN`` files (weights and client state, no optimizer state).

    PP 1: ``mp_rank_{tp:02d}_model_states.pt`` with ``module`` (what the non-pipeline engine reads; under ZeRO-3
    megatron.ds loads it as module weights and partitions them). PP > 1: the pipeline engine's
    ``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` files plus one client-state file per model rank. The stream is
    first written as a TP `tp` Megatron checkpoint in a staging folder (megatron_format: about one layer resident),
    then each tensor rank's file is reopened memory-mapped and rewritten in DeepSpeed's layout, one rank at a time.
    `bigscience`: layer files at any PP, numbered as Megatron-DeepSpeed's GPTModelPipe (BigScience's BLOOM
    checkpoints; `bigscience_index`), which the non-pipeline engine does not read.
    """
    import copy
    import dataclasses
    import shutil

    from megatron.checkpoint.atomic_io import atomic_torch_save, atomic_write_text
    from megatron.checkpoint.conversion.megatron_format import (
        find_iteration_dir,
        rank_files,
        sign_output,
        write_megatron,
    )
    from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
    from megatron.models.gpt.model_pipe import pipe_layers_from_megatron_state_dict

    if meta.model_type != "GPT":
        raise ConversionError(f"--saver deepspeed writes GPT checkpoints (--model-type {meta.model_type} is not "
                              "supported)")
    num_layers = int(meta.architecture["num_layers"])
    if pp > 1 and num_layers % pp:
        raise ConversionError(f"--target-pipeline-parallel-size {pp} does not divide the {num_layers} layers")
    meta = dataclasses.replace(meta, extra={k: v for k, v in meta.extra.items() if k != "optimizer"})
    iteration = 0 if meta.iteration is None else int(meta.iteration)
    meta.iteration = iteration
    staging = os.path.join(save_dir, ".megatron_staging")
    write_megatron(meta, messages, staging, tp, 1, None)
    files = rank_files(find_iteration_dir(staging)[0])
    tag = f"global_step{iteration}"
    tag_dir = os.path.join(save_dir, tag)
    state = engine_state(iteration, int(meta.consumed_train_samples), tp, pp)
    written = []
    client: Dict[str, Any] = {}
    for t in range(tp):
        sd = load_checkpoint_file(files[(t, 0)], trust=True)  # our own staging file, memory-mapped
        args = copy.deepcopy(sd.get("args"))
        if args is not None:
            args.pipeline_model_parallel_size = pp
        client = {"iteration": iteration, "args": args, "checkpoint_version": sd.get("checkpoint_version", 3.0)}
        for key in ("architecture", "consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens",
                    "consumed_valid_tokens", "opt_param_scheduler", "padded_vocab_size", "true_vocab_size"):
            if sd.get(key) is not None:
                client[key] = sd[key]
        flat = flatten_checkpoint_state_dict(sd["model"])
        if pp == 1 and not bigscience:
            path = os.path.join(tag_dir, f"mp_rank_{t:02d}_model_states.pt")
            atomic_torch_save({"module": flat, **state, **client}, path)
            written.append(path)
        else:
            for idx, layer in sorted(pipe_layers_from_megatron_state_dict(flat, num_layers).items()):
                idx = bigscience_index(idx, num_layers) if bigscience else idx
                path = os.path.join(tag_dir, f"layer_{idx:02d}-model_{t:02d}-model_states.pt")
                atomic_torch_save({k: v.clone() for k, v in layer.items()}, path)
                written.append(path)
        del sd, flat
    if pp > 1 or bigscience:
        for p in range(pp):  # DeepSpeed's grid numbers model-parallel ranks pipeline-major
            for t in range(tp):
                path = os.path.join(tag_dir, f"mp_rank_{p * tp + t:02d}_model_states.pt")
                atomic_torch_save({"module": None, **state, **client}, path)
                written.append(path)
    shutil.rmtree(staging, ignore_errors=True)
    sign_output(tag_dir, meta)
    atomic_write_text(os.path.join(save_dir, LATEST), tag)
    return {"files": written, "tp": tp, "pp": pp, "tag": tag, "iteration": iteration, "bigscience": bigscience}
