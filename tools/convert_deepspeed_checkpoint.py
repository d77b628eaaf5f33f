"""Convert a DeepSpeed checkpoint of pretrain_gpt.py --deepspeed into Megatron's layout (and back, weights only).

DeepSpeed → Megatron (so generation, evaluation and the HF converter work on it)::

    python tools/convert_deepspeed_checkpoint.py --input-folder ds_ckpt --output-folder megatron_ckpt \
        [--iteration N] [--target-tp T] [--target-pp P]

Megatron → DeepSpeed (model weights and client state only; resume it with --no-load-optim --no-load-rng or
--finetune)::

    python tools/convert_deepspeed_checkpoint.py --to-deepspeed --input-folder megatron_ckpt --output-folder ds_ckpt

DeepSpeed layouts read (``latest`` names the tag, or --iteration N picks ``global_step{N}``):

- non-pipeline engine, ZeRO 0/1/2: ``global_step{N}/mp_rank_{tp:02d}_model_states.pt`` whose ``module`` is the
  GPTModel state dict of tensor rank ``tp``;
- ZeRO-3: ``zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt`` hold placeholders only; the weights are consolidated
  from the fp32 partitions in ``*_optim_states.pt`` with DeepSpeed's own ``deepspeed.utils.zero_to_fp32`` (one tensor
  rank at a time);
- pipeline engine (GPTModelPipe): ``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` per pipe layer, mapped back to
  Megatron names with ``megatron.model.gpt_model_pipe.megatron_state_dict_from_pipe_layers``.

Megatron layout written: ``latest_checkpointed_iteration.txt`` and ``iter_{N:07d}/mp_rank_{tp:02d}[_{pp:03d}]/
model_optim_rng.pt`` with ``model`` (Megatron's nested dict), ``args``, ``iteration``, ``checkpoint_version``,
consumed samples and the scheduler state; no optimizer state, and the RNG state only when the layout is unchanged
(non-pipeline, same TP) — load it with --no-load-optim --no-load-rng, or --finetune, as the inference tools do.
By default the output keeps the source's tensor/pipeline sizes; --target-tp/--target-pp reshard the weights.
"""
from __future__ import annotations

import argparse
import copy
import glob
import os
import re
import sys
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.atomic_io import atomic_torch_save as _save  # noqa: E402
from megatron.atomic_io import atomic_write_text as _write_text  # noqa: E402
from megatron.checkpoint_integrity import write_manifest  # noqa: E402
from megatron.errors import MegatronUserError, exit_on_user_error  # noqa: E402
from megatron.safe_load import guarded_torch_load, safe_torch_load  # noqa: E402

CHECKPOINT_VERSION = 3.0
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DS_LATEST = "latest"
LM = "language_model."

_MP_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
_MEG_RANK_RE = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")
_LAYER_KEY_RE = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.*)$")


class ConvertCheckpointError(MegatronUserError, ValueError):
    """The input checkpoint is missing, of an unknown layout, or does not fit the requested target layout."""


# ----------------------------------------------------------------------------------------------- small helpers
def _load(path: str) -> dict:
    # megatron.safe_load: weights-only with the allow-list of DeepSpeed's/Megatron's types; main() decides the trust.
    return safe_torch_load(path, map_location="cpu")


def nest_megatron_state_dict(flat: dict[str, Any]) -> dict[str, Any]:
    """Flat GPTModel ``state_dict()`` → Megatron's nested checkpoint dict (``state_dict_for_save_checkpoint``)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(LM):
            part, _, tail = key[len(LM):].partition(".")
            lm = out.setdefault("language_model", {})
            if part == "embedding":
                sub, _, leaf = tail.partition(".")
                lm.setdefault("embedding", {}).setdefault(sub, {})[leaf] = value
            else:
                lm.setdefault(part, {})[tail] = value
        elif key.startswith("word_embeddings."):
            out.setdefault("word_embeddings_for_head", {})[key[len("word_embeddings."):]] = value
        else:
            out[key] = value
    return out


def flatten_megatron_state_dict(nested: dict[str, Any]) -> dict[str, Any]:
    """Megatron's nested checkpoint dict (or an already flat one) → flat GPTModel names."""
    from megatron.model.gpt_model import flatten_checkpoint_state_dict

    return flatten_checkpoint_state_dict(nested)


def _num_layers_in(flat: dict[str, Any]) -> int:
    ids = {int(m.group(1)) for m in map(_LAYER_KEY_RE.match, flat) if m}
    return max(ids) + 1 if ids else 0


# ----------------------------------------------------------------------------------------------- pipeline split
def split_pipeline_stages(full: dict[str, Any], num_layers: int, pp: int) -> list[dict[str, Any]]:
    """One tensor rank's full flat state dict → ``pp`` stage dicts as Megatron's GPTModel names them.

    Layers are split evenly (as ``layers_on_this_stage``) and renumbered from 0 on each stage; the embedding goes to
    the first stage, the final LayerNorm / untied output layer to the last, which (PP > 1, tied embeddings) also
    gets the head's copy of the word embeddings as ``word_embeddings.weight``.
    """
    if pp == 1:
        return [dict(full)]
    if num_layers % pp != 0:
        raise ConvertCheckpointError(f"--target-pp {pp} does not divide the {num_layers} layers of the checkpoint")
    per = num_layers // pp
    stages: list[dict[str, Any]] = [{} for _ in range(pp)]
    for key, value in full.items():
        m = _LAYER_KEY_RE.match(key)
        if m:
            layer = int(m.group(1))
            stages[layer // per][f"language_model.encoder.layers.{layer % per}.{m.group(2)}"] = value
        elif key.startswith(LM + "embedding."):
            stages[0][key] = value
            if key == LM + "embedding.word_embeddings.weight" and LM + "output_layer.weight" not in full:
                stages[-1]["word_embeddings.weight"] = value
        elif key == "word_embeddings.weight":
            continue  # head copy of a PP>1 source: re-derived from the embedding above
        else:
            stages[-1][key] = value
    return stages


def merge_pipeline_stages(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """Inverse of ``split_pipeline_stages``: stage dicts (in order) → one full flat state dict (PP = 1 names)."""
    full: dict[str, Any] = {}
    offset = 0
    for stage in stages:
        n = _num_layers_in(stage)
        for key, value in stage.items():
            m = _LAYER_KEY_RE.match(key)
            if m:
                full[f"language_model.encoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"] = value
            elif key == "word_embeddings.weight" and len(stages) > 1:
                continue  # the last stage's copy of the tied embedding
            else:
                full[key] = value
        offset += n
    return full


# ----------------------------------------------------------------------------------------------- tensor reshard
def _pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.size(0) == rows:
        return t
    if t.size(0) > rows:
        return t[:rows].clone()
    return torch.cat([t, t.new_zeros((rows - t.size(0),) + tuple(t.shape[1:]))], dim=0)


def reshard_tensor_parallel(shards: list[dict[str, Any]], target_tp: int, args: Optional[argparse.Namespace],
                            true_vocab_size: Optional[int]) -> tuple[list[dict[str, Any]], Optional[int]]:
    """TP shards of one pipeline layout → ``target_tp`` shards; returns them and the new padded vocabulary size."""
    from megatron.model.tp_shards import merge_tensor_parallel_state_dicts, split_tensor_parallel_state_dict

    if len(shards) == target_tp:
        return shards, getattr(args, "padded_vocab_size", None)
    full = merge_tensor_parallel_state_dicts(shards) if len(shards) > 1 else dict(shards[0])
    old_rows = full[LM + "embedding.word_embeddings.weight"].size(0) if LM + "embedding.word_embeddings.weight" in full \
        else full["word_embeddings.weight"].size(0)
    multiple = int(getattr(args, "make_vocab_size_divisible_by", 128) or 128) * target_tp
    new_rows = old_rows
    if old_rows % multiple != 0 or true_vocab_size is not None:
        if true_vocab_size is None:
            raise ConvertCheckpointError(
                f"--target-tp {target_tp} needs the vocabulary padded to a multiple of {multiple} (it has {old_rows} "
                "rows): pass --true-vocab-size N (the tokenizer's vocabulary size) to re-pad it")
        new_rows = -(-true_vocab_size // multiple) * multiple
    for key in (LM + "embedding.word_embeddings.weight", "word_embeddings.weight", LM + "output_layer.weight"):
        if key in full:
            full[key] = _pad_vocab(full[key], new_rows)
    try:
        return split_tensor_parallel_state_dict(full, target_tp), new_rows
    except ValueError as exc:
        raise ConvertCheckpointError(f"--target-tp {target_tp}: {exc}") from None


# ----------------------------------------------------------------------------------------------- DeepSpeed input
def _resolve_ds_tag_dir(folder: str, iteration: Optional[int]) -> str:
    if not os.path.isdir(folder):
        raise ConvertCheckpointError(f"--input-folder {folder} does not exist")
    if glob.glob(os.path.join(folder, "*_model_states.pt")):
        return folder  # pointed directly at global_step{N}/
    tags = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    if iteration is not None:
        tag = f"global_step{iteration}"
    else:
        latest = os.path.join(folder, DS_LATEST)
        if not os.path.isfile(latest):
            if os.path.isfile(os.path.join(folder, MEGATRON_TRACKER)):
                raise ConvertCheckpointError(f"--input-folder {folder} is a Megatron checkpoint ({MEGATRON_TRACKER}); "
                                             "add --to-deepspeed to convert it to DeepSpeed's layout")
            hint = f" (found {', '.join(tags[:5])})" if tags else ""
            raise ConvertCheckpointError(f"no '{DS_LATEST}' file in --input-folder {folder}: pass --iteration N to pick "
                                         f"global_step{{N}}{hint}, or point it at a DeepSpeed checkpoint folder")
        with open(latest) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(folder, tag)
    if not os.path.isdir(tag_dir):
        raise ConvertCheckpointError(f"DeepSpeed checkpoint {tag_dir} does not exist (tags found: "
                                     f"{', '.join(tags) or 'none'}); fix --iteration or the '{DS_LATEST}' file")
    return tag_dir


def _iteration_from(meta: dict, tag_dir: str) -> int:
    if "iteration" in meta:
        return int(meta["iteration"])
    m = re.search(r"(\d+)$", os.path.basename(os.path.normpath(tag_dir)))
    if m:
        return int(m.group(1))
    return int(meta.get("global_steps", 0))


def _zero3_rank_state(tag_dir: str, tp: int) -> dict[str, Any]:
    """Consolidate one tensor rank of a ZeRO-3 checkpoint with deepspeed.utils.zero_to_fp32 (fp32 master weights)."""
    from megatron.checkpoint_conversion.deepspeed_format import zero3_rank_state
    from megatron.checkpoint_conversion.interchange import ConversionError

    try:
        return zero3_rank_state(tag_dir, tp)
    except ConversionError as exc:
        raise ConvertCheckpointError(str(exc)) from None


def read_deepspeed_checkpoint(folder: str, iteration: Optional[int] = None) -> dict[str, Any]:
    """Read a DeepSpeed checkpoint: {'tp_shards': [full flat state dict per TP rank], 'meta', 'layout', ...}.

    ``layout`` is 'module' (ZeRO 0/1/2), 'zero3' or 'pipe'; ``meta`` holds the client state saved with it
    (``args``, ``iteration``, ``rng_state``, ``opt_param_scheduler``, ``checkpoint_version``) of model rank 0.
    """
    tag_dir = _resolve_ds_tag_dir(folder, iteration)
    names = sorted(os.listdir(tag_dir))
    mp_files = {int(m.group(1)): n for n in names for m in [_MP_RE.match(n)] if m}
    zero3_files = {(int(m.group(1)), int(m.group(2))): n for n in names for m in [_ZERO3_RE.match(n)] if m}
    layer_files = {(int(m.group(1)), int(m.group(2))): n for n in names for m in [_LAYER_RE.match(n)] if m}

    if layer_files:
        layout = "pipe"
    elif mp_files:
        layout = "module"
    elif zero3_files:
        layout = "zero3"
    else:
        raise ConvertCheckpointError(
            f"{tag_dir} is not a DeepSpeed checkpoint of a known layout (no mp_rank_XX_model_states.pt, "
            "zero_pp_rank_X_mp_rank_XX_model_states.pt or layer_XX-model_XX-model_states.pt files)")

    meta_file = mp_files.get(0) or zero3_files.get((0, 0)) or (next(iter(mp_files.values())) if mp_files else None)
    if meta_file is None:
        raise ConvertCheckpointError(f"{tag_dir} has layer files but no mp_rank_00_model_states.pt (client state)")
    meta = _load(os.path.join(tag_dir, meta_file))
    args = meta.get("args")
    per_rank_meta: dict[int, dict] = {}

    shards: list[dict[str, Any]] = []
    if layout == "module":
        tps = sorted(mp_files)
        if tps != list(range(len(tps))):
            raise ConvertCheckpointError(f"{tag_dir}: tensor ranks {tps} are not 0..{len(tps) - 1}; a file is missing")
        for tp in tps:
            state = meta if tp == 0 else _load(os.path.join(tag_dir, mp_files[tp]))
            module = state.get("module")
            if module is None:
                raise ConvertCheckpointError(f"{os.path.join(tag_dir, mp_files[tp])} holds no 'module' weights")
            if any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in module.values()):
                raise ConvertCheckpointError(
                    f"{tag_dir}: the weights in {mp_files[tp]} are ZeRO-3 placeholders and no optimizer partitions "
                    "were found: run DeepSpeed's zero_to_fp32.py on the checkpoint first")
            shards.append(dict(module))
            per_rank_meta[tp] = state
    elif layout == "zero3":
        tps = sorted({tp for _, tp in zero3_files})
        for tp in tps:
            shards.append(_zero3_rank_state(tag_dir, tp))
            per_rank_meta[tp] = meta if tp == 0 else _load(os.path.join(tag_dir, zero3_files[(0, tp)]))
    else:
        from megatron.model.gpt_model_pipe import megatron_state_dict_from_pipe_layers

        tps = sorted({tp for _, tp in layer_files})
        num_layers = getattr(args, "num_layers", None)
        if num_layers is None:
            raise ConvertCheckpointError(f"{tag_dir}/{meta_file} has no Megatron 'args' (client state): cannot tell "
                                         "the number of transformer layers of this pipeline checkpoint")
        for tp in tps:
            layers = {idx: _load(os.path.join(tag_dir, n)) for (idx, t), n in sorted(layer_files.items()) if t == tp}
            try:
                shards.append(dict(megatron_state_dict_from_pipe_layers(layers, num_layers)))
            except ValueError as exc:
                raise ConvertCheckpointError(f"{tag_dir} (tensor rank {tp}): {exc}") from None
    return {"tp_shards": shards, "meta": meta, "args": args, "layout": layout, "tag_dir": tag_dir,
            "iteration": _iteration_from(meta, tag_dir), "per_rank_meta": per_rank_meta}


def _source_pp(ds: dict) -> int:
    if ds["layout"] != "pipe":
        return 1
    return int(getattr(ds["args"], "pipeline_model_parallel_size", 1) or 1)


def deepspeed_to_megatron(input_folder: str, output_folder: str, iteration: Optional[int] = None,
                          target_tp: Optional[int] = None, target_pp: Optional[int] = None,
                          true_vocab_size: Optional[int] = None) -> dict[str, Any]:
    """Convert; returns {'iteration', 'tp', 'pp', 'files', 'layout'}."""
    ds = read_deepspeed_checkpoint(input_folder, iteration)
    args = copy.deepcopy(ds["args"])
    src_tp, src_pp = len(ds["tp_shards"]), _source_pp(ds)
    if args is not None:
        saved_tp = int(getattr(args, "tensor_model_parallel_size", src_tp) or 1)
        if saved_tp != src_tp:
            raise ConvertCheckpointError(f"{ds['tag_dir']} holds {src_tp} tensor-parallel shards but its args say "
                                         f"--tensor-model-parallel-size {saved_tp}; the checkpoint is incomplete")
    tp = target_tp or src_tp
    pp = target_pp or src_pp
    shards, padded = reshard_tensor_parallel(ds["tp_shards"], tp, args, true_vocab_size)
    num_layers = _num_layers_in(shards[0])
    if args is not None and getattr(args, "num_layers", num_layers) != num_layers:
        raise ConvertCheckpointError(f"{ds['tag_dir']} has {num_layers} transformer layers but its args say "
                                     f"--num-layers {args.num_layers}")
    it = ds["iteration"]
    iter_dir = os.path.join(output_folder, f"iter_{it:07d}")
    if os.path.exists(iter_dir):
        raise ConvertCheckpointError(f"{iter_dir} already exists: choose another --output-folder or delete it")
    same_layout = ds["layout"] != "pipe" and tp == src_tp and pp == 1
    if args is not None:
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
        if padded is not None:
            args.padded_vocab_size = padded
    files = []
    for t, shard in enumerate(shards):
        for p, stage in enumerate(split_pipeline_stages(shard, num_layers, pp)):
            meta = ds["per_rank_meta"].get(t, ds["meta"])
            sd: dict[str, Any] = {
                "args": args,
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": it,
                "model": nest_megatron_state_dict(stage),
            }
            for key in ("consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens",
                        "consumed_valid_tokens"):
                sd[key] = int(getattr(args, key, 0) or 0) if args is not None else 0
            sd["padded_vocab_size"] = padded
            sched = meta.get("opt_param_scheduler")
            if sched is not None:
                sd["opt_param_scheduler"] = sched
                sd["lr_scheduler"] = sched
            if same_layout and meta.get("rng_state") is not None:
                sd["rng_state"] = meta["rng_state"]
            rank_dir = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            path = os.path.join(iter_dir, rank_dir, "model_optim_rng.pt")
            _save(sd, path)
            files.append(path)
    write_manifest(iter_dir)  # sizes + CRC-32 of the files, before the tracker (megatron/checkpoint_integrity.py)
    _write_text(os.path.join(output_folder, MEGATRON_TRACKER), str(it))
    return {"iteration": it, "tp": tp, "pp": pp, "files": files, "layout": ds["layout"], "rng": same_layout}


# ----------------------------------------------------------------------------------------------- Megatron input
def read_megatron_checkpoint(folder: str, iteration: Optional[int] = None) -> dict[str, Any]:
    """{'tp_shards': [full flat dict per TP rank], 'meta': rank (0,0) file, 'iteration', 'pp'} of a Megatron ckpt."""
    if not os.path.isdir(folder):
        raise ConvertCheckpointError(f"--input-folder {folder} does not exist")
    if iteration is None:
        tracker = os.path.join(folder, MEGATRON_TRACKER)
        if not os.path.isfile(tracker):
            if os.path.isfile(os.path.join(folder, DS_LATEST)):
                raise ConvertCheckpointError(f"--input-folder {folder} is a DeepSpeed checkpoint ('{DS_LATEST}' file); "
                                             "drop --to-deepspeed to convert it to Megatron's layout")
            raise ConvertCheckpointError(f"no {MEGATRON_TRACKER} in --input-folder {folder}: pass --iteration N")
        text = open(tracker).read().strip()
        sub = "release" if text == "release" else None
        if sub is None:
            try:
                iteration = int(text)
            except ValueError:
                raise ConvertCheckpointError(f"{tracker} holds {text!r}, not an iteration number") from None
    else:
        sub = None
    iter_dir = os.path.join(folder, sub or f"iter_{iteration:07d}")
    if not os.path.isdir(iter_dir):
        raise ConvertCheckpointError(f"Megatron checkpoint {iter_dir} does not exist; fix --iteration or the tracker")
    ranks: dict[tuple[int, int], str] = {}
    for d in os.listdir(iter_dir):
        m = _MEG_RANK_RE.match(d)
        if m and os.path.isfile(os.path.join(iter_dir, d, "model_optim_rng.pt")):
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(iter_dir, d, "model_optim_rng.pt")
    if not ranks:
        raise ConvertCheckpointError(f"{iter_dir} has no mp_rank_XX[_YYY]/model_optim_rng.pt files")
    tp = max(t for t, _ in ranks) + 1
    pp = max(p for _, p in ranks) + 1
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in ranks]
    if missing:
        raise ConvertCheckpointError(f"{iter_dir} is incomplete: no file for (tensor, pipeline) ranks {missing}")
    meta = _load(ranks[(0, 0)])
    shards = []
    for t in range(tp):
        stages = []
        for p in range(pp):
            state = meta if (t, p) == (0, 0) else _load(ranks[(t, p)])
            if "model" not in state:
                raise ConvertCheckpointError(f"{ranks[(t, p)]} has no 'model' entry (virtual pipeline chunks are "
                                             "not supported by this converter)")
            stages.append(flatten_megatron_state_dict(state["model"]))
        shards.append(merge_pipeline_stages(stages))
    it = int(meta.get("iteration", iteration or 0)) if sub is None else 0
    return {"tp_shards": shards, "meta": meta, "args": meta.get("args"), "iteration": it, "pp": pp}


def megatron_to_deepspeed(input_folder: str, output_folder: str, iteration: Optional[int] = None,
                          target_tp: Optional[int] = None, target_pp: Optional[int] = None,
                          true_vocab_size: Optional[int] = None) -> dict[str, Any]:
    """Megatron → DeepSpeed weights: non-pipeline ``mp_rank_XX_model_states.pt`` (PP 1) or pipe layer files."""
    meg = read_megatron_checkpoint(input_folder, iteration)
    args = copy.deepcopy(meg["args"])
    tp = target_tp or len(meg["tp_shards"])
    pp = target_pp or meg["pp"]
    shards, padded = reshard_tensor_parallel(meg["tp_shards"], tp, args, true_vocab_size)
    num_layers = _num_layers_in(shards[0])
    it = meg["iteration"]
    tag = f"global_step{it}"
    tag_dir = os.path.join(output_folder, tag)
    if os.path.exists(tag_dir):
        raise ConvertCheckpointError(f"{tag_dir} already exists: choose another --output-folder or delete it")
    if args is not None:
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
        if padded is not None:
            args.padded_vocab_size = padded
    client = {"iteration": it, "args": args, "checkpoint_version": CHECKPOINT_VERSION}
    sched = meg["meta"].get("opt_param_scheduler", meg["meta"].get("lr_scheduler"))
    if sched is not None:
        client["opt_param_scheduler"] = sched
    import importlib.metadata

    try:
        ds_version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds_version = "0.0.0"
    engine_state = {"buffer_names": [], "optimizer": None, "lr_scheduler": None, "skipped_steps": 0,
                    "global_steps": it, "global_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
                    "dp_world_size": 1, "mp_world_size": tp * pp, "ds_version": ds_version,
                    "param_shapes": None, "frozen_param_shapes": None, "shared_params": {},
                    "frozen_param_fragments": None, "data_sampler": None, "random_ltd": None,
                    "checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": tp}}
    files = []
    if pp == 1:
        for t, shard in enumerate(shards):
            path = os.path.join(tag_dir, f"mp_rank_{t:02d}_model_states.pt")
            _save({"module": shard, **engine_state, **client}, path)
            files.append(path)
    else:
        from megatron.model.gpt_model_pipe import pipe_layers_from_megatron_state_dict

        for t, shard in enumerate(shards):
            try:
                layers = pipe_layers_from_megatron_state_dict(shard, num_layers)
            except ValueError as exc:
                raise ConvertCheckpointError(f"--to-deepspeed --target-pp {pp}: {exc}") from None
            for idx, layer_sd in sorted(layers.items()):
                path = os.path.join(tag_dir, f"layer_{idx:02d}-model_{t:02d}-model_states.pt")
                _save(layer_sd, path)
                files.append(path)
        for p in range(pp):  # DeepSpeed's grid numbers model-parallel ranks pipeline-major
            for t in range(tp):
                path = os.path.join(tag_dir, f"mp_rank_{p * tp + t:02d}_model_states.pt")
                _save({"module": None, **engine_state, **client}, path)
                files.append(path)
    write_manifest(tag_dir)
    _write_text(os.path.join(output_folder, DS_LATEST), tag)
    return {"iteration": it, "tp": tp, "pp": pp, "files": files, "tag": tag}


# ----------------------------------------------------------------------------------------------- CLI
def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert a DeepSpeed checkpoint (global_step{N}/, latest) of pretrain_gpt.py --deepspeed into "
                    "Megatron's layout (iter_{N:07d}/mp_rank_XX/model_optim_rng.pt), or back with --to-deepspeed.")
    parser.add_argument("--input-folder", required=True,
                        help="DeepSpeed checkpoint folder (holding 'latest' and global_step{N}/, or a global_step "
                             "folder itself); a Megatron checkpoint folder with --to-deepspeed")
    parser.add_argument("--output-folder", required=True, help="Where to write the converted checkpoint")
    parser.add_argument("--iteration", type=int, default=None,
                        help="Convert global_step{N} / iter_{N:07d} instead of the one named by 'latest'")
    parser.add_argument("--target-tp", type=int, default=None,
                        help="Tensor-parallel size of the output (default: the input's)")
    parser.add_argument("--target-pp", type=int, default=None,
                        help="Pipeline-parallel size of the output (default: the input's; use 1 for single-process "
                             "generation). With --to-deepspeed, > 1 writes pipe-engine layer files")
    parser.add_argument("--true-vocab-size", type=int, default=None,
                        help="Tokenizer vocabulary size, needed only when --target-tp changes the vocab padding")
    parser.add_argument("--to-deepspeed", action="store_true",
                        help="Reverse direction: Megatron checkpoint → DeepSpeed checkpoint (weights only)")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="Load the input with full unpickling (can run code in it); default: weights-only with an "
                             "allow-list (also MEGATRON_TRUST_CHECKPOINT=1)")
    return parser


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = get_parser().parse_args(argv)
    for flag, value in (("--target-tp", args.target_tp), ("--target-pp", args.target_pp),
                        ("--true-vocab-size", args.true_vocab_size), ("--iteration", args.iteration)):
        if value is not None and value < (0 if flag == "--iteration" else 1):
            raise ConvertCheckpointError(f"{flag} must be positive, got {value}")
    if os.path.abspath(args.input_folder) == os.path.abspath(args.output_folder):
        raise ConvertCheckpointError("--output-folder must differ from --input-folder")
    convert = megatron_to_deepspeed if args.to_deepspeed else deepspeed_to_megatron
    with guarded_torch_load(trust=args.trust_checkpoint):  # our _load and DeepSpeed's zero_to_fp32 alike
        result = convert(args.input_folder, args.output_folder, iteration=args.iteration, target_tp=args.target_tp,
                         target_pp=args.target_pp, true_vocab_size=args.true_vocab_size)
    if args.to_deepspeed:
        print(f"wrote DeepSpeed checkpoint {result['tag']} (TP={result['tp']}, PP={result['pp']}, weights only) to "
              f"{args.output_folder}; resume with --no-load-optim --no-load-rng or --finetune", flush=True)
    else:
        rng = "" if result["rng"] else " --no-load-rng"
        print(f"wrote Megatron checkpoint iteration {result['iteration']} (TP={result['tp']}, PP={result['pp']}, "
              f"from a {result['layout']} DeepSpeed checkpoint) to {args.output_folder}; load it with "
              f"--tensor-model-parallel-size {result['tp']} --pipeline-model-parallel-size {result['pp']} "
              f"--no-load-optim{rng} (or --finetune)", flush=True)
    return result


if __name__ == "__main__":
    exit_on_user_error(main)
