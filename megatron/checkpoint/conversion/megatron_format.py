"""Megatron checkpoints (``latest_checkpointed_iteration.txt``, ``iter_N``/``release``, ``mp_rank_TT[_PPP]``) as a
conversion loader and saver, at any tensor / pipeline / virtual-pipeline layout.

Reading opens every rank file memory-mapped through the safe loader (weights-only + allow-list) and merges one
layer at a time with the parameters' own TP layouts (megatron.layers.tp_shards), so the resident memory stays about one
layer plus the embeddings. QKV rows of checkpoint_version 0 ([3, heads, d]) and 1.0 ([heads, d, 3]) are reordered
to the current [heads, 3, d]. Writing splits each layer for the target TP, groups layers into the target's pipeline
stages / virtual chunks (Megatron's layer offsets), pads the vocabulary for the target TP (repeating the last row,
output layer too) and writes Megatron's files with ``args``, ``architecture``, ``checkpoint_version`` 3.0 and the
iteration. With the training state (the loader's ``optimizer=True``; optimizer_state.py) the optimizer state of
either optimizer is converted too and written as ``distrib_optim.pt`` per rank, with the iteration, consumed samples
and LR schedule, so ``--load`` continues the run (``--no-load-rng``: the RNG streams of another layout do not
exist); without it the files hold no optimizer or RNG state (load with --finetune or --no-load-optim --no-load-rng),
except that a DeepSpeed source's RNG states are kept when the layout is unchanged (same TP, PP 1).
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.checkpoint import integrity
from megatron.checkpoint.args import saved_architecture
from megatron.checkpoint.atomic_io import atomic_torch_save, atomic_write_text
from megatron.checkpoint.conversion import optimizer_state as ostate
from megatron.checkpoint.conversion.interchange import (
    EMBEDDINGS,
    FINAL_NORM,
    MTP,
    MTP_PREFIX,
    NO_ARGS_HINT,
    OUTPUT_LAYER,
    ConversionError,
    Message,
    ModelMeta,
    architecture_of,
    args_namespace,
    expect,
    layer_message,
)
from megatron.checkpoint.conversion.qkv_versions import fix_qkv_ordering
from megatron.checkpoint.conversion.vocab import repad_rows, target_rows
from megatron.checkpoint.safe_load import CheckpointFileError, UnsafeCheckpointError, safe_torch_load
from megatron.core.tensor_parallel.layout import REPLICATED, TensorParallelLayout, get_tp_layout
from megatron.layers.checkpoint_keys import STATE_ONLY_SUFFIXES, flatten_checkpoint_state_dict
from megatron.layers.tp_shards import tensor_parallel_layouts
from megatron.models import registry
from megatron.run_configs.saved_args import SavedRunArgs

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
LM = "language_model."
ENC = LM + "encoder."
LAYERS = ENC + "layers."
WORD = LM + "embedding.word_embeddings.weight"
POS = LM + "embedding.position_embeddings.weight"
EMB_NORM = LM + "embedding.word_embeddings.norm."  # --embed-layernorm (Megatron-DeepSpeed's name)
OUT = LM + "output_layer.weight"
HEAD_COPY = "word_embeddings.weight"
TOKENTYPE = LM + "embedding.tokentype_embeddings.weight"
# last-stage parts after the final norm: (flat name prefix, message name); the output layer, then each family's
# declared head modules (BERT's pooler and heads: megatron/models/bert/checkpoint_layout.py); the multi-token-
# prediction block (megatron/layers/mtp.py, any GPT model with --mtp-num-layers) is the model's, like the output layer
HEAD_PARTS = ((LM + "output_layer.", OUTPUT_LAYER), (MTP_PREFIX, MTP),
              *((h.prefix, h.message) for layout in registry.LAYOUTS for h in layout.heads))
NESTED_HEADS = (MTP_PREFIX, *(h.prefix for layout in registry.LAYOUTS for h in layout.heads if h.nested))  # one level
VOCAB_ROWS = (OUT, "lm_head.bias")  # tensors with one row per vocabulary entry besides the word embeddings
_RANK_RE = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")
_LAYER_RE = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.+)$")


# ----------------------------------------------------------------------------------------------- layout maths
def chunk_of_layer(i: int, num_layers: int, pp: int, vp: int) -> Tuple[int, int, int]:
    """(pipeline rank, virtual chunk, local index) of global layer `i` (Megatron's offsets)."""
    per_chunk = num_layers // (pp * vp)
    c, local = divmod(i, per_chunk)
    return c % pp, c // pp, local


def check_layout(num_layers: int, pp: int, vp: int, what: str) -> None:
    if num_layers % (pp * vp):
        extra = f" x {vp} virtual chunks" if vp > 1 else ""
        raise ConversionError(f"{what}: {num_layers} layers do not split into {pp} pipeline stage(s){extra}")


def layer_layouts(meta: ModelMeta) -> Dict[str, TensorParallelLayout]:
    """{parameter name of the TP=1 model: its TP layout} (declared by the layers, built on the meta device)."""
    arch = dict(meta.architecture, padded_vocab_size=max(1, meta.architecture.get("padded_vocab_size") or 1))
    family = registry.layout_for(meta.model_type)
    own = meta.extra.get(family.extra_key) if family.layout_model is not None else None  # the family's record
    key = tuple(sorted((k, v if isinstance(v, (bool, int, float, str, type(None))) else repr(v))
                       for k, v in arch.items()))
    key += (meta.model_type, tuple(sorted((own or {}).items())))
    if key not in _LAYOUT_CACHE:
        config = meta.config(padded_vocab_size=arch["padded_vocab_size"])
        if own is None:
            layouts = tensor_parallel_layouts(config)
            for name, layout in list(layouts.items()):  # every layer kind's names under layer 0 (MoE and dense)
                m = _LAYER_RE.match(name)
                if m:
                    layouts.setdefault(f"{LAYERS}0.{m.group(2)}", layout)
            _LAYOUT_CACHE[key] = layouts
        else:
            model = family.layout_model(config, own)
            _LAYOUT_CACHE[key] = {name: get_tp_layout(p) for name, p in model.named_parameters()}
    return _LAYOUT_CACHE[key]


_LAYOUT_CACHE: Dict[tuple, Dict[str, TensorParallelLayout]] = {}


def _layout(layouts: Dict[str, TensorParallelLayout], name: str) -> TensorParallelLayout:
    m = _LAYER_RE.match(name)
    key = f"{LAYERS}0.{m.group(2)}" if m else name
    if key == HEAD_COPY:
        key = WORD
    return layouts.get(key, REPLICATED)


# ----------------------------------------------------------------------------------------------- reading
def find_iteration_dir(load_dir: str, iteration: Optional[int] = None) -> Tuple[str, Optional[int]]:
    """(iteration folder, iteration or None for ``release``) named by the tracker file, or ``iter_{iteration}``."""
    if not os.path.isdir(load_dir):
        raise ConversionError(f"--load-dir {load_dir} does not exist")
    if iteration is not None:
        iter_dir = os.path.join(load_dir, f"iter_{iteration:07d}")
        if not os.path.isdir(iter_dir):
            raise ConversionError(f"Megatron checkpoint {iter_dir} does not exist; fix --iteration")
        return iter_dir, iteration
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        hint = ""
        if os.path.isfile(os.path.join(load_dir, "latest")):
            hint = " (it looks like a DeepSpeed checkpoint: use --loader deepspeed)"
        elif os.path.isfile(os.path.join(load_dir, "config.json")):
            hint = " (it looks like a Hugging Face model: use --loader hf)"
        raise ConversionError(f"--load-dir {load_dir} is not a Megatron checkpoint: no {TRACKER}{hint}")
    try:
        text = integrity.read_pointer_file(tracker)
    except ValueError as exc:
        raise ConversionError(str(exc)) from None
    if text == "release":
        return os.path.join(load_dir, "release"), None
    try:
        iteration = int(text)
    except ValueError:
        raise ConversionError(f"{tracker} holds {text!r}, not an iteration number or 'release'") from None
    return os.path.join(load_dir, f"iter_{iteration:07d}"), iteration


def verified_source(load_dir: str, iter_dir: str, iteration: Optional[int], explicit: bool,
                    layout: str = "megatron") -> Tuple[str, Optional[int], bool]:
    """(iteration folder, iteration, verified) to read, checked against its manifest as --load does: the newest
    intact iteration at or below the named one (one WARNING line naming what was skipped); an explicitly named
    (--iteration) or ``release`` folder that does not verify is a one-line ConversionError. `verified` is False for a
    folder without a manifest (older saves): it is read with a note, and what is written from it is not signed."""
    reason = integrity.verify(iter_dir)
    if reason is None or reason == integrity.NO_MANIFEST:
        return iter_dir, iteration, _note_unverified(iter_dir, reason)
    if explicit or iteration is None:
        raise ConversionError(f"checkpoint {iter_dir} is damaged: {reason}; restore it (its files no longer match "
                              f"its {integrity.MANIFEST_NAME}) or convert another iteration")
    skipped = [f"{os.path.basename(iter_dir)} ({reason})"]
    for cand in (it for it in integrity.iterations(load_dir, layout) if it < iteration):
        cand_dir = integrity.iteration_dir(load_dir, cand, layout)
        cand_reason = integrity.verify(cand_dir)
        if cand_reason is None or cand_reason == integrity.NO_MANIFEST:
            print(f"WARNING: skipped damaged checkpoint {'; '.join(skipped)} in {load_dir}; converting "
                  f"{os.path.basename(cand_dir)} instead", flush=True)
            return cand_dir, cand, _note_unverified(cand_dir, cand_reason)
        skipped.append(f"{os.path.basename(cand_dir)} ({cand_reason})")
    raise ConversionError(f"no intact checkpoint in {load_dir}: {'; '.join(skipped)}; restore one")


def _note_unverified(iter_dir: str, reason: Optional[str]) -> bool:
    if reason is None:
        return True
    print(f"note: {iter_dir} has no manifest.json (saved before integrity checks): converted without verifying it, "
          "and the output is not signed either", flush=True)
    return False


def sign_output(iter_dir: str, meta: ModelMeta) -> None:
    """Write the output's manifest, unless the source was read unverified (never sign what was not verified)."""
    if meta.extra.get("unverified_source"):
        integrity.remove_manifest(iter_dir)
        return
    integrity.write_manifest(iter_dir)  # crc32 per file, as saves do


_EXPERT_RANK_RE = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")
EXPERT_PARAM_RE = re.compile(r"\.mlp\.experts\.(weight|bias)[12]$")  # stacked experts: dim 0 is the (local) expert


def experts_stored_whole(args: Any) -> bool:
    """A checkpoint saved with --expert-tensor-parallel-size != TP holds each expert rank's experts whole (not split
    like the dense weights of its folder): Megatron-LM's folders mp_rank_TT[_PPP][_EEE] name the dense TP rank, so
    they cannot hold expert-TP shards; the experts are gathered over the expert-TP group on saving."""
    saved = SavedRunArgs.from_args(args)
    etp, tp = saved.expert_tensor_parallel_size, saved.tensor_model_parallel_size or 1
    return etp is not None and etp != tp


def expert_rank_files(iter_dir: str) -> Tuple[int, Dict[Tuple[int, int, int], str]]:
    """(EP size, {(tp, pp, expert rank): model_optim_rng.pt}) of a checkpoint saved with expert parallelism
    (Megatron-LM's mp_rank_TT[_PPP]_EEE folders); (1, {}) for any other checkpoint. The saved args tell whether
    mp_rank_TT_NNN names a pipeline or an expert rank. Saved with expert-TP != TP, only the (TP rank, expert rank)
    pairs some rank holds have a folder: every TP rank and every expert rank must appear (experts_stored_whole)."""
    if not os.path.isdir(iter_dir):
        return 1, {}
    found = {d: _EXPERT_RANK_RE.match(d) for d in sorted(os.listdir(iter_dir))}
    found = {d: m for d, m in found.items() if m and os.path.isfile(os.path.join(iter_dir, d, "model_optim_rng.pt"))}
    if not found:
        return 1, {}
    args = load_checkpoint_file(os.path.join(iter_dir, next(iter(found)), "model_optim_rng.pt"), False).get("args")
    saved = SavedRunArgs.from_args(args)
    ep = saved.expert_model_parallel_size
    if ep == 1:
        return 1, {}
    staged = saved.pipeline_model_parallel_size > 1
    files: Dict[Tuple[int, int, int], str] = {}
    for d, m in found.items():
        nums = [int(g) for g in m.groups() if g is not None]
        if len(nums) != (3 if staged else 2):
            raise ConversionError(f"{iter_dir}/{d} does not follow the expert-parallel naming mp_rank_TT"
                                  f"{'_PPP' if staged else ''}_EEE of its args; remove the stale folder")
        t, p, e = (nums if staged else (nums[0], 0, nums[1]))
        files[(t, p, e)] = os.path.join(iter_dir, d, "model_optim_rng.pt")
    tp, pp = max(k[0] for k in files) + 1, max(k[1] for k in files) + 1
    if experts_stored_whole(args):  # each TP rank's dense weights and each expert rank's experts somewhere
        need = [(t, p, None) for t in range(tp) for p in range(pp)] + \
            [(None, p, e) for p in range(pp) for e in range(ep)]
        missing = [(t, p, e) for t, p, e in need if not any(k[1] == p and t in (None, k[0]) and e in (None, k[2])
                                                              for k in files)]
    else:
        missing = [k for k in ((t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)) if k not in files]
    if missing:
        t, p, e = missing[0]
        raise ConversionError(f"{iter_dir}: no folder for tensor rank {'any' if t is None else t}, pipeline rank "
                              f"{p}, expert rank {'any' if e is None else e} (EP={ep}); the checkpoint is incomplete")
    return ep, files


def dense_rank_files(files: Dict[Tuple[int, int, int], str]) -> Dict[Tuple[int, int], str]:
    """{(tp, pp): the folder of the lowest expert rank with that TP rank} of expert_rank_files' folders."""
    out: Dict[Tuple[int, int], str] = {}
    for (t, p, _), path in sorted(files.items()):
        out.setdefault((t, p), path)
    return out


def expert_source(files: Dict[Tuple[int, int, int], str], t: int, p: int, e: int) -> str:
    """The folder holding expert rank e's experts for TP rank t: (t, p, e), else (saved with expert-TP != TP, the
    experts whole) the one of the lowest TP rank holding expert rank e."""
    if (t, p, e) in files:
        return files[(t, p, e)]
    return files[min(k for k in files if k[1] == p and k[2] == e)]


def merge_experts(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Expert ranks' flat state dicts -> one: expert params concatenated over dim 0, the rest from expert rank 0."""
    out = dict(per_rank[0])
    for name in out:
        if EXPERT_PARAM_RE.search(name):
            out[name] = torch.cat([sd[name] for sd in per_rank], dim=0)
    return out


def rank_files(iter_dir: str) -> Dict[Tuple[int, int], str]:
    """{(tp rank, pp rank): model_optim_rng.pt} of an iteration folder; one-line errors for missing files."""
    if not os.path.isdir(iter_dir):
        raise ConversionError(f"checkpoint folder {iter_dir} (named by the tracker file) does not exist")
    ranks: Dict[Tuple[int, int], str] = {}
    pp_named = set()
    for d in sorted(os.listdir(iter_dir)):
        m = _RANK_RE.match(d)
        if not m:
            continue
        pp_named.add(m.group(2) is not None)
        path = os.path.join(iter_dir, d, "model_optim_rng.pt")
        if not os.path.isfile(path):
            raise ConversionError(f"missing rank file {path}; the checkpoint is incomplete")
        ranks[(int(m.group(1)), int(m.group(2) or 0))] = path
    if not ranks:
        raise ConversionError(f"{iter_dir} has no mp_rank_XX[_YYY]/model_optim_rng.pt files")
    if len(pp_named) > 1:
        raise ConversionError(f"{iter_dir} mixes mp_rank_XX and mp_rank_XX_YYY folders; remove the stale ones")
    tp = max(t for t, _ in ranks) + 1
    pp = max(p for _, p in ranks) + 1
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in ranks]
    if missing:
        t, p = missing[0]
        name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 or True in pp_named else "")
        raise ConversionError(f"missing rank file {os.path.join(iter_dir, name, 'model_optim_rng.pt')} "
                              f"(tensor rank {t}, pipeline rank {p} of TP={tp} x PP={pp}); the checkpoint is incomplete")
    return ranks


def load_checkpoint_file(path: str, trust: bool) -> Dict[str, Any]:
    """Load one Megatron checkpoint file on CPU (memory-mapped when it can be); ConversionError if it is not a dict."""
    try:
        sd = safe_torch_load(path, map_location="cpu", trust=trust, mmap=True)
    except (CheckpointFileError, UnsafeCheckpointError):
        raise
    except Exception:  # noqa: BLE001 - an old (non-zip) file cannot be memory-mapped: read it normally
        sd = safe_torch_load(path, map_location="cpu", trust=trust)
    if not isinstance(sd, dict):
        raise ConversionError(f"{path} is not a Megatron checkpoint file (a {type(sd).__name__}, not a dict)")
    return sd


def _recorded_architecture(sd: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """(the file's architecture, stored or from its args; the sizes it lacks of num_layers, hidden_size, heads)."""
    arch = saved_architecture(sd.get("architecture"), sd.get("args"))
    saved = SavedRunArgs.from_args(sd.get("args"))
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if key not in arch and getattr(saved, key) is not None:
            arch[key] = getattr(saved, key)
    return arch, [k for k in ("num_layers", "hidden_size", "num_attention_heads") if arch.get(k) is None]


def architecture_from(sd: Dict[str, Any], path: str, flags: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The file's architecture (stored, or from its args); `flags` (this run's) for a file with neither."""
    arch, missing = _recorded_architecture(sd)
    if missing and flags is not None:
        return dict(flags)
    if missing:
        raise ConversionError(f"{path} stores neither 'architecture' nor args with {', '.join(missing)}: "
                              f"{NO_ARGS_HINT}")
    return arch


class MegatronCheckpointReader:
    """The files of one Megatron checkpoint iteration, memory-mapped, with per-layer merging."""

    def __init__(self, load_dir: str, trust: bool = False, iteration: Optional[int] = None,
                 verify: bool = True, flags: Optional[Dict[str, Any]] = None) -> None:
        self.load_dir = load_dir
        self.iter_dir, self.iteration = find_iteration_dir(load_dir, iteration)
        self.verified = True  # verify=False: the caller verified the folder itself
        if verify:
            self.iter_dir, self.iteration, self.verified = verified_source(load_dir, self.iter_dir, self.iteration,
                                                                           iteration is not None)
        self.ep, self.expert_files = expert_rank_files(self.iter_dir)
        if self.ep > 1:  # expert parallelism: the experts of every rank's folders are merged on reading
            self.files = dense_rank_files(self.expert_files)
        else:
            self.files = rank_files(self.iter_dir)
        self.tp = max(t for t, _ in self.files) + 1
        self.pp = max(p for _, p in self.files) + 1
        self.trust = trust
        first = load_checkpoint_file(self.files[(0, 0)], trust)
        self.first = first
        self.experts_whole = experts_stored_whole(first.get("args"))  # saved with expert-TP != TP
        if not any(k == "model" or re.fullmatch(r"model\d+", k) for k in first):
            raise ConversionError(f"{self.files[(0, 0)]} has no 'model' entry: not a Megatron model checkpoint")
        self.vp = sum(1 for k in first if re.fullmatch(r"model\d+", k)) or 1
        self.version = float(first.get("checkpoint_version", 0) or 0)
        self.architecture = architecture_from(first, self.files[(0, 0)], flags)  # flags: a file without args
        self.from_flags = flags is not None and bool(_recorded_architecture(first)[1])
        # {(tp, pp, vp): flat state dict}
        self.chunks: Dict[Tuple[int, int, int], Dict[str, Any]] = {}
        self.optim_entries: Dict[Tuple[int, int], Any] = {}  # each rank file's 'optimizer' entry (memory-mapped)
        self._open()
        # {(tp, pp, vp): {name: {"param", "exp_avg", ...}}} when the training state is carried (optimizer_state.py)
        self.opt: Optional[Dict[Tuple[int, int, int], Dict[str, Dict[str, torch.Tensor]]]] = None
        self.opt_common: Dict[str, Any] = {}

    def _open(self) -> None:
        # expert parallelism: {(tp, pp, vp): [flat state dict of each expert rank]}, {(tp, pp): [optimizer entries]}
        self.expert_chunks: Dict[Tuple[int, int, int], List[Dict[str, Any]]] = {}
        self.expert_optim: Dict[Tuple[int, int], List[Any]] = {}
        self.expert_paths: Dict[Tuple[int, int], List[str]] = {}  # the folder of each expert rank's experts
        self.own_chunks: Dict[Tuple[int, int, int], Dict[str, Any]] = {}  # (t, p)'s own file when not expert rank 0's

        def flat_of(one: Dict[str, Any], key: str) -> Dict[str, Any]:
            flat = flatten_checkpoint_state_dict(one[key])
            if OUT in flat and WORD not in flat and self.architecture.get("share_embeddings_and_output_weights"):
                flat[HEAD_COPY] = flat.pop(OUT)  # Megatron Core's name for the tied head copy (last stage)
            return flat

        for (t, p), path in sorted(self.files.items()):
            sd = self.first if (t, p) == (0, 0) else load_checkpoint_file(path, self.trust)
            self.optim_entries[(t, p)] = sd.get("optimizer")
            keys = ["model"] if self.vp == 1 else [f"model{v}" for v in range(self.vp)]
            sources = [expert_source(self.expert_files, t, p, e) for e in range(self.ep)] if self.ep > 1 else [path]
            opened = {path: sd}
            for source in sources:
                if source not in opened:
                    opened[source] = load_checkpoint_file(source, self.trust)
            ones = [opened[source] for source in sources]
            self.expert_paths[(t, p)] = sources
            self.expert_optim[(t, p)] = [o.get("optimizer") for o in ones]
            for v, key in enumerate(keys):
                for one, where in ((sd, path), *zip(ones, sources)):
                    if key not in one:
                        raise ConversionError(f"{where} has no '{key}' entry: its virtual pipeline chunks differ from "
                                              f"{self.files[(0, 0)]} (mismatched shards)")
                flats = [flat_of(one, key) for one in ones]
                self.expert_chunks[(t, p, v)] = flats
                merged = merge_experts(flats) if self.ep > 1 else flats[0]
                if sources[0] != path:  # expert-TP != TP: TP rank t's dense weights are in its own folder
                    own = self.own_chunks[(t, p, v)] = flat_of(sd, key)
                    merged = {k: merged[k] if EXPERT_PARAM_RE.search(k) else x for k, x in own.items()}
                self.chunks[(t, p, v)] = merged
        for (t, p, v), flat in self.chunks.items():
            ref = self.chunks[(0, p, v)]
            if set(flat) != set(ref):
                diff = sorted(set(flat) ^ set(ref))[:2]
                raise ConversionError(f"{self.files[(t, p)]} and {self.files[(0, p)]} hold different parameters "
                                      f"({', '.join(diff)}): mismatched shards")
        counts = [self._layers_in(p, v) for v in range(self.vp) for p in range(self.pp)]
        total = sum(counts)
        if self.architecture.get("num_layers") not in (None, total):
            if self.from_flags:
                raise ConversionError(f"{self.iter_dir} records no args and holds {total} layers but the flags give "
                                      f"num_layers={self.architecture['num_layers']}: pass --num-layers {total}")
            raise ConversionError(f"{self.iter_dir} holds {total} layers but its args say num_layers="
                                  f"{self.architecture['num_layers']}: mismatched shards")
        if len(set(counts)) > 1:
            raise ConversionError(f"{self.iter_dir}: pipeline chunks hold unequal layer counts {counts}")
        self.architecture["num_layers"] = total

    def parameter_order(self, meta: ModelMeta) -> List[str]:
        """The TP=1 model's parameter names in ``named_parameters()`` order (the regular optimizer's order)."""
        return list(layer_layouts(meta))

    def open_optimizer(self, meta: ModelMeta) -> None:
        """Read every rank's optimizer state into per-parameter entries (nothing when the checkpoint has none)."""
        expert_optim = getattr(self, "expert_optim", None) or {k: [o] for k, o in self.optim_entries.items()}
        if not all(ostate.has_training_state(e) for per in expert_optim.values() for e in per):
            return
        if self.version < 2.0:
            raise ConversionError(f"{self.iter_dir}: checkpoint_version {self.version} optimizer states are not "
                                  "converted; pass --no-save-optim to convert the weights only")
        full_order = self.parameter_order(meta)
        self.opt, steps, keys = {}, set(), set()
        def entries_of(optim_sd: Dict[str, Any], chunks: List[Dict[str, Any]], path: str) -> tuple:
            if optim_sd.get("distributed_optimizer"):
                dpath = os.path.join(os.path.dirname(path), "distrib_optim.pt")
                if not os.path.isfile(dpath):
                    raise ConversionError(f"missing rank file {dpath} (saved with --use-distributed-optimizer); "
                                          "the checkpoint is incomplete (or pass --no-save-optim)")
                return ostate.distributed_entries(load_checkpoint_file(dpath, self.trust), chunks, dpath)
            return ostate.regular_entries(optim_sd, chunks, full_order, path, ours="architecture" in self.first)

        for (t, p) in sorted(self.optim_entries):
            per_expert_rank = []
            paths = getattr(self, "expert_paths", {}).get((t, p), [self.files[(t, p)]])
            for e, optim_sd in enumerate(expert_optim[(t, p)]):
                chunks = [self.expert_chunks[(t, p, v)][e] if self.ep > 1 else self.chunks[(t, p, v)]
                          for v in range(self.vp)]
                entries, step, k = entries_of(optim_sd, chunks, paths[e])
                per_expert_rank.append(entries)
            dense = per_expert_rank[0]
            if paths[0] != self.files[(t, p)]:  # expert-TP != TP: TP rank t's dense state is in its own folder
                dense, _, _ = entries_of(self.optim_entries[(t, p)], [self.own_chunks[(t, p, v)]
                                                                       for v in range(self.vp)], self.files[(t, p)])
            for v in range(self.vp):
                merged = dict(dense[v])
                for name in merged:
                    if EXPERT_PARAM_RE.search(name):
                        merged[name] = {k: torch.cat([r[v][name][k] for r in per_expert_rank], dim=0)
                                        for k in merged[name]}
                self.opt[(t, p, v)] = merged
            steps.add(step)
            keys.update(k)
        self.opt_common = ostate.common_part(self.optim_entries[(0, 0)])
        self.opt_common.update(step=max(steps), state_keys=sorted(keys))

    def opt_merged(self, p: int, v: int, name: str, layout: TensorParallelLayout) -> Dict[str, torch.Tensor]:
        """The full (TP=1) training-state entry of parameter `name`, merged like its weight; {} without state."""
        if self.opt is None:
            return {}
        per_rank = [self.opt[(t, p, v)].get(name) for t in range(self.tp)]
        if any(e is None for e in per_rank):
            raise ConversionError(f"{self.iter_dir}: no optimizer state for {name} on every tensor rank: mismatched "
                                  "shards (or pass --no-save-optim)")
        if layout.replicated or self.tp == 1 or (getattr(self, "experts_whole", False) and EXPERT_PARAM_RE.search(name)):
            return dict(per_rank[0])
        try:
            return {k: layout.merge([e[k] for e in per_rank], name) for k in per_rank[0]}
        except (ValueError, RuntimeError, KeyError) as exc:
            raise ConversionError(f"{self.iter_dir}: cannot merge the optimizer state of {name} over {self.tp} "
                                  f"tensor ranks ({str(exc).splitlines()[0][:160]}): mismatched shards") from None

    def _layers_in(self, p: int, v: int) -> int:
        ids = {int(m.group(1)) for m in map(_LAYER_RE.match, self.chunks[(0, p, v)]) if m}
        return max(ids) + 1 if ids else 0

    def merged(self, p: int, v: int, name: str, layout: TensorParallelLayout) -> torch.Tensor:
        shards = [self.chunks[(t, p, v)][name] for t in range(self.tp)]
        if layout.replicated or self.tp == 1 or (getattr(self, "experts_whole", False) and EXPERT_PARAM_RE.search(name)):
            # no copy: the memory-mapped tensor itself (saved with expert-TP != TP: whole experts in every folder)
            return shards[0]
        try:
            return layout.merge(shards, name)
        except (ValueError, RuntimeError) as exc:
            raise ConversionError(f"{self.iter_dir}: cannot merge {name} over {self.tp} tensor ranks "
                                  f"({str(exc).splitlines()[0][:160]}): mismatched shards") from None


def megatron_meta(reader: MegatronCheckpointReader, true_vocab_size: Optional[int], model_type: str) -> ModelMeta:
    sd, args = reader.first, reader.first.get("args")
    saved = SavedRunArgs.from_args(args)
    tok: Dict[str, Any] = saved.tokenizer_dict()
    true_vocab = true_vocab_size or sd.get("true_vocab_size") or saved.true_vocab_size
    src = sd if "consumed_train_samples" in sd else vars(args) if args is not None else {}
    tokens = tuple(int((sd[k] if sd.get(k) is not None else getattr(saved, k)) or 0)
                   for k in ("consumed_train_tokens", "consumed_valid_tokens"))
    return ModelMeta(
        model_type=model_type, architecture=dict(reader.architecture), true_vocab_size=true_vocab,
        iteration=None if reader.iteration is None else int(sd.get("iteration", reader.iteration)),
        checkpoint_args=args, consumed_train_samples=int(src.get("consumed_train_samples", 0) or 0),
        consumed_valid_samples=int(src.get("consumed_valid_samples", 0) or 0),
        make_vocab_size_divisible_by=saved.make_vocab_size_divisible_by,
        tokenizer=tok, source=reader.load_dir,
        extra={"tp": reader.tp, "pp": reader.pp, "vp": reader.vp, "ep": getattr(reader, "ep", 1),  # DeepSpeed: 1
               "consumed_tokens": tokens,
               "opt_param_scheduler": sd.get("opt_param_scheduler", sd.get("lr_scheduler")),
               "unverified_source": None if getattr(reader, "verified", True) else reader.iter_dir})


def attach_optimizer_state(reader: Any, meta: ModelMeta, padded: int) -> None:
    """Open the reader's training state (optimizer_state.py) and announce it in `meta`; an optimizer state in a layout
    we do not know is a note, and the weights convert alone."""
    try:
        reader.open_optimizer(meta)
    except ostate.ForeignOptimizerState as exc:
        print(f"note: {exc}: its optimizer state is not converted; writing the weights only", flush=True)
        reader.opt = None
    if reader.opt is not None:
        meta.extra["optimizer"] = reader.opt_common
        meta.extra["source_padded_vocab_size"] = padded
        tokens = reader.first.get("consumed_train_tokens")
        if tokens is not None:
            meta.extra["consumed_tokens"] = (int(tokens), int(reader.first.get("consumed_valid_tokens", 0) or 0))


def read_megatron(load_dir: str, *, true_vocab_size: Optional[int] = None, model_type: str = "GPT",
                  trust: bool = False, optimizer: bool = False, iteration: Optional[int] = None,
                  verify: bool = True, flags: Optional[Dict[str, Any]] = None) -> Tuple[ModelMeta, Iterator[Message]]:
    """Loader: (meta, message stream) of a Megatron checkpoint at any TP/PP/virtual-PP layout (the iteration the
    tracker names, or `iteration`); with `optimizer`, the messages also carry the training state when the checkpoint
    has one (GPT and BERT models; optimizer_state.py); `flags`: the architecture of files that record none."""
    if registry.layout_for(model_type).encoder_decoder:  # its own stream, t5_format.read_t5 (built on this module)
        raise ConversionError(f"read_megatron reads GPT/BERT checkpoints: read {model_type} ones with "
                              "t5_format.read_t5")
    reader = MegatronCheckpointReader(load_dir, trust, iteration, verify, flags)
    meta = megatron_meta(reader, true_vocab_size, model_type)
    padded = reader.merged(0, 0, WORD, TensorParallelLayout(dim=0)).size(0) if WORD in reader.chunks[(0, 0, 0)] \
        else None
    if padded is None:
        raise ConversionError(f"{reader.files[(0, 0)]} has no {WORD}: not a GPT checkpoint (or a damaged first stage)")
    meta.architecture["padded_vocab_size"] = padded
    first, last = reader.chunks[(0, 0, 0)], reader.chunks[(0, reader.pp - 1, reader.vp - 1)]
    found = registry.layout_holding(last)  # the family whose own modules the last stage holds (else the default)
    asked = registry.layout_for(model_type)
    if found is not (asked if asked.markers else registry.LAYOUTS[0]):
        raise ConversionError(f"{load_dir} holds a {found.model_type} checkpoint: pass --model-type {found.model_type}")
    if found.describe is not None:
        meta.extra[found.extra_key] = found.describe(first, last)
    if meta.true_vocab_size is not None and meta.true_vocab_size > padded:
        raise ConversionError(f"--true-vocab-size {meta.true_vocab_size} exceeds the checkpoint's {padded} "
                              "vocabulary rows")
    if optimizer and meta.iteration is not None:  # one-stack models (the model type was checked above)
        attach_optimizer_state(reader, meta, padded)
    return meta, stream_messages(reader, meta)


def stream_messages(reader: MegatronCheckpointReader, meta: ModelMeta) -> Iterator[Message]:
    """The checkpoint's tensors as conversion messages (embeddings, layers, final norm, head), merged over TP/PP."""
    layouts = layer_layouts(meta)
    # with the training state the padded rows stay as trained (see optimizer_state.py)
    rows = slice(0, meta.true_vocab_size if reader.opt is None else None)
    first, last = (0, 0), (reader.pp - 1, reader.vp - 1)

    def opt(p: int, v: int, name: str, cut: bool = False) -> Dict[str, torch.Tensor]:
        if reader.opt is None or name not in reader.opt[(0, p, v)]:  # no state, or not a trained parameter
            return {}
        entry = reader.opt_merged(p, v, name, _layout(layouts, name))
        return {k: t[rows] for k, t in entry.items()} if cut else entry

    emb = {"word_embeddings.weight": reader.merged(*first, WORD, _layout(layouts, WORD))[rows]}
    emb_opt = {"word_embeddings.weight": opt(*first, WORD, cut=True)}
    for name in (POS, TOKENTYPE, EMB_NORM + "weight", EMB_NORM + "bias"):
        if name in reader.chunks[(0, 0, 0)]:
            emb[name[len(LM + "embedding."):]] = reader.chunks[(0, 0, 0)][name]
            emb_opt[name[len(LM + "embedding."):]] = opt(*first, name)
    yield Message(EMBEDDINGS, emb, {k: e for k, e in emb_opt.items() if e})
    a = meta.architecture
    nh = a["num_attention_heads"]
    hd = a.get("kv_channels") or a["hidden_size"] // nh
    num_layers = a["num_layers"]
    for i in range(num_layers):
        p, v, local = chunk_of_layer(i, num_layers, reader.pp, reader.vp)
        prefix = f"{LAYERS}{local}."
        tensors, layer_opt = {}, {}
        for name in reader.chunks[(0, p, v)]:
            if not name.startswith(prefix):
                continue
            suffix = name[len(prefix):]
            if suffix.endswith("_extra_state"):
                continue
            entry = opt(p, v, name)
            if entry:
                layer_opt[suffix] = entry
            if reader.version < 2.0 and "query_key_value" in suffix:
                try:
                    per_rank = [fix_qkv_ordering(reader.chunks[(t, p, v)][name], reader.version, nh // reader.tp, hd)
                                for t in range(reader.tp)]
                except ValueError as exc:
                    raise ConversionError(f"{reader.files[(0, p)]}: {exc}") from None
                tensors[suffix] = _layout(layouts, name).merge(per_rank, name)
            else:
                tensors[suffix] = reader.merged(p, v, name, _layout(layouts, name))
        yield Message(layer_message(i), tensors, layer_opt)
    last_chunk = reader.chunks[(0, *last)]
    norm = {k[len(ENC):]: last_chunk[k] for k in last_chunk if k.startswith(ENC + "final_layernorm.")}
    if not norm:
        raise ConversionError(f"{reader.files[(0, reader.pp - 1)]} has no final_layernorm: incomplete last stage")
    norm_opt = {k: opt(*last, ENC + k) for k in norm}
    yield Message(FINAL_NORM, norm, {k: e for k, e in norm_opt.items() if e})
    if not a.get("share_embeddings_and_output_weights", True) and OUT not in last_chunk:
        raise ConversionError(f"{reader.files[(0, reader.pp - 1)]} has no {OUT} but the architecture is untied")
    for prefix, message in HEAD_PARTS:
        tensors, head_opt = {}, {}
        for name in last_chunk:
            if name.startswith(prefix):
                t = reader.merged(*last, name, _layout(layouts, name))
                key = name[len(prefix):] if message != OUTPUT_LAYER else name[len(LM):]
                tensors[key] = t[rows] if name in VOCAB_ROWS else t
                entry = opt(*last, name, cut=name in VOCAB_ROWS)
                if entry:
                    head_opt[key] = entry
        if tensors:
            yield Message(message, tensors, head_opt)


# ----------------------------------------------------------------------------------------------- writing
def nest(flat: Dict[str, Any]) -> Dict[str, Any]:
    """Flat GPTModel names -> Megatron's nested checkpoint dict (``state_dict_for_save_checkpoint`` layout)."""
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(LM):
            part, _, tail = key[len(LM):].partition(".")
            lm = out.setdefault("language_model", {})
            if part == "embedding":
                sub, _, leaf = tail.partition(".")
                lm.setdefault("embedding", {}).setdefault(sub, {})[leaf] = value
            else:
                lm.setdefault(part, {})[tail] = value
        elif key == HEAD_COPY:
            out.setdefault("word_embeddings_for_head", {})["weight"] = value
        elif key.startswith(NESTED_HEADS):
            # a family's top-level heads (BERT's, pretraining and finetuned): one level, as its model saves them
            head, _, tail = key.partition(".")
            out.setdefault(head, {})[tail] = value
        else:
            out[key] = value
    return out


def _saved_args(meta: ModelMeta, tp: int, pp: int, vp_layers: Optional[int], padded: int,
                ep: int = 1) -> argparse.Namespace:
    src = meta.checkpoint_args
    if isinstance(src, argparse.Namespace):
        args = copy.copy(src)
    else:
        args = args_namespace(meta)
        for key, value in vars(src or argparse.Namespace()).items():
            setattr(args, key, value)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.expert_model_parallel_size = ep
    if getattr(args, "expert_tensor_parallel_size", None) is not None:
        args.expert_tensor_parallel_size = tp
    args.num_layers_per_virtual_pipeline_stage = vp_layers
    args.virtual_pipeline_model_parallel_size = (meta.architecture["num_layers"] // pp // vp_layers
                                                 if vp_layers else None)
    args.padded_vocab_size = padded
    args.num_layers = meta.architecture["num_layers"]
    family = registry.layout_for(meta.model_type)
    if family.saved_args is not None:
        family.saved_args(args, meta.extra[family.extra_key])
    return args


class MegatronWriter:
    """Consumes the message stream chunk by chunk and writes a Megatron checkpoint under `save_dir`."""

    def __init__(self, meta: ModelMeta, save_dir: str, tp: int, pp: int, vp_layers: Optional[int],
                 ep: int = 1) -> None:
        a = meta.architecture
        self.meta, self.save_dir, self.tp, self.pp, self.ep = meta, save_dir, tp, pp, ep
        experts = a.get("num_moe_experts")
        if ep > 1 and (not experts or experts % ep):
            raise ConversionError(f"--target-expert-parallel-size {ep} must divide the model's experts "
                                  f"({experts or 'none: not an MoE model'})")
        self.num_layers = a["num_layers"]
        self.vp = self.num_layers // pp // vp_layers if vp_layers else 1
        if vp_layers and (self.num_layers % (pp * vp_layers) or self.vp < 1):
            raise ConversionError(f"--target-num-layers-per-virtual-pipeline-stage {vp_layers} does not split "
                                  f"{self.num_layers} layers over {pp} pipeline stages")
        if self.vp > 1 and pp < 2:
            raise ConversionError("--target-num-layers-per-virtual-pipeline-stage needs "
                                  "--target-pipeline-parallel-size >= 2")
        check_layout(self.num_layers, pp, self.vp, f"--target-pipeline-parallel-size {pp}")
        self.vp_layers = vp_layers if self.vp > 1 else None
        heads, groups = a["num_attention_heads"], a.get("num_query_groups") or a["num_attention_heads"]
        if heads % tp or groups % tp:
            raise ConversionError(f"--target-tensor-parallel-size {tp} must divide the {heads} attention heads and "
                                  f"{groups} query groups")
        self.iteration = meta.iteration
        self.iter_name = "release" if meta.iteration is None else f"iter_{meta.iteration:07d}"

    def _chunk_file(self, t: int, p: int, e: int = 0) -> str:
        rank = f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "") + (f"_{e:03d}" if self.ep > 1 else "")
        return os.path.join(self.save_dir, self.iter_name, rank, "model_optim_rng.pt")

    def _expert_slice(self, flat: Dict[str, Any], e: int) -> Dict[str, Any]:
        """Expert rank e's part of a flat dict (its local experts; a copy, so only they are saved)."""
        if self.ep == 1:
            return flat
        out = {}
        for name, value in flat.items():
            if EXPERT_PARAM_RE.search(name):
                n = value.size(0) // self.ep
                value = value[e * n:(e + 1) * n].clone()
            out[name] = value
        return out

    def _expert_slice_entries(self, entries: Dict[str, Dict[str, Any]], e: int) -> Dict[str, Dict[str, Any]]:
        """The optimizer entries {name: {"param", "exp_avg", ...}} of expert rank e."""
        if self.ep == 1:
            return entries
        return {name: ({k: x[e * (x.size(0) // self.ep):(e + 1) * (x.size(0) // self.ep)].clone()
                        for k, x in entry.items()} if EXPERT_PARAM_RE.search(name) else entry)
                for name, entry in entries.items()}

    def write(self, messages: Iterator[Message]) -> List[str]:
        """Split each part for the target TP as it arrives and spill its shards to a staging file that is reopened
        memory-mapped, so the resident memory is about one layer; then write each rank file from the staged parts."""
        meta = self.meta
        emb_msg = expect(messages, EMBEDDINGS)
        emb, emb_opt = emb_msg.tensors, emb_msg.optimizer
        word = emb["word_embeddings.weight"]
        rows = target_rows(word.size(0), meta.true_vocab_size, meta.make_vocab_size_divisible_by, self.tp)
        self.padded = rows
        meta.architecture["padded_vocab_size"] = rows
        self.layouts = layer_layouts(meta)
        self.parts: Dict[Tuple[int, int, int], Dict[str, Any]] = {
            (t, p, v): {} for t in range(self.tp) for p in range(self.pp) for v in range(self.vp)}
        self.opt_parts: Dict[Tuple[int, int, int], Dict[str, Dict[str, Any]]] = {k: {} for k in self.parts}
        self.with_optimizer = bool(meta.extra.get("optimizer"))
        self.staging = os.path.join(self.save_dir, ".staging")
        last = (self.pp - 1, self.vp - 1)
        emb_flat = {WORD: repad_rows(word, rows)}
        opt_flat = {WORD: {k: repad_rows(x, rows) for k, x in emb_opt.get("word_embeddings.weight", {}).items()}}
        for key in ("position_embeddings.weight", "tokentype_embeddings.weight", "word_embeddings.norm.weight",
                    "word_embeddings.norm.bias"):  # the last two: --embed-layernorm (BLOOM)
            if key in emb:
                emb_flat[LM + "embedding." + key] = emb[key]
                opt_flat[LM + "embedding." + key] = emb_opt.get(key, {})
        tied = meta.architecture.get("share_embeddings_and_output_weights", True)
        if (tied or meta.architecture.get("mtp_num_layers")) and self.pp > 1:  # the last stage's copy of the
            # embedding (word_embeddings_for_head: the tied output layer's, the MTP block's input); its gradient is
            # all-reduced with the first stage's, so its optimizer state is the same
            self._stage("head", last, {HEAD_COPY: emb_flat[WORD]}, {HEAD_COPY: opt_flat[WORD]})
        self._stage("embeddings", (0, 0), emb_flat, opt_flat)
        del word, emb, emb_flat, emb_opt, opt_flat, emb_msg
        for i in range(self.num_layers):
            p, v, local = chunk_of_layer(i, self.num_layers, self.pp, self.vp)
            msg = expect(messages, layer_message(i))
            self._stage(f"layer{i}", (p, v), {f"{LAYERS}{local}.{k}": t for k, t in msg.tensors.items()},
                        {f"{LAYERS}{local}.{k}": e for k, e in msg.optimizer.items()})
            del msg
        norm_msg = expect(messages, FINAL_NORM)
        self._stage("final_norm", last, {ENC + k: t for k, t in norm_msg.tensors.items()},
                    {ENC + k: e for k, e in norm_msg.optimizer.items()})
        prefixes = {message: prefix for prefix, message in HEAD_PARTS}
        seen = set()
        for msg in messages:
            if msg.name not in prefixes or msg.name in seen:
                raise ConversionError(f'unexpected message "{msg.name}" after the final norm (is --model-type right?)')
            seen.add(msg.name)
            prefix = prefixes[msg.name] if msg.name != OUTPUT_LAYER else LM
            flat = {prefix + k: t for k, t in msg.tensors.items()}
            flat = {k: repad_rows(t, rows) if k in VOCAB_ROWS else t for k, t in flat.items()}
            flat_opt = {prefix + k: {s: repad_rows(x, rows) if prefix + k in VOCAB_ROWS else x for s, x in e.items()}
                        for k, e in msg.optimizer.items()}
            self._stage(msg.name.replace(" ", "_"), last, flat, flat_opt)
        if not tied and OUTPUT_LAYER not in seen:
            raise ConversionError("the loader sent no output layer for an untied model")
        files = self._write_files()
        sign_output(os.path.join(self.save_dir, self.iter_name), self.meta)
        atomic_write_text(os.path.join(self.save_dir, TRACKER),
                          "release" if self.iteration is None else str(self.iteration))
        return files

    def _split(self, chunk: Dict[str, Any]) -> List[Dict[str, Any]]:
        shards: List[Dict[str, Any]] = [{} for _ in range(self.tp)]
        for name, value in chunk.items():
            layout = _layout(self.layouts, name)
            try:
                # TP 1 needs no split: no anonymous copy of each tensor on its way to the staging file
                parts = [value] * self.tp if layout.replicated or self.tp == 1 else layout.split(value, self.tp, name)
            except ValueError as exc:
                raise ConversionError(f"--target-tensor-parallel-size {self.tp}: {exc}") from None
            for t, part in enumerate(parts):
                shards[t][name] = part
        return shards

    def _stage(self, tag: str, where: Tuple[int, int], tensors: Dict[str, Any],
               opt: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        p, v = where
        for t, shard in enumerate(self._split(tensors)):
            self.parts[(t, p, v)].update(self._spill(f"{tag}_{t}", shard))
        if not self.with_optimizer:
            return
        missing = [name for name in tensors if not (opt or {}).get(name) and not name.endswith(STATE_ONLY_SUFFIXES)]
        if missing:
            raise ConversionError(f"the loader sent no optimizer state for {missing[0]}; pass --no-save-optim to "
                                  "convert the weights only")
        for key in sorted({k for e in opt.values() for k in e}):  # "param", "exp_avg", "exp_avg_sq" (Muon:
            # "momentum_buffer" of its matrices, the moments of the rest)
            for t, shard in enumerate(self._split({name: e[key] for name, e in opt.items() if key in e})):
                for name, x in self._spill(f"{tag}_{key}_{t}", shard).items():
                    self.opt_parts[(t, p, v)].setdefault(name, {})[key] = x

    def _spill(self, stem: str, shard: Dict[str, Any]) -> Dict[str, Any]:
        """Write `shard` to the staging folder and reopen it memory-mapped (bounded resident memory)."""
        path = os.path.join(self.staging, f"{stem}.pt")
        os.makedirs(self.staging, exist_ok=True)
        torch.save({k: x.contiguous() for k, x in shard.items()}, path)
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)

    def _write_files(self) -> List[str]:
        files = []
        for t, p, e in ((t, p, e) for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)):
            last = e == self.ep - 1  # the staged parts of (t, p) are released after its last expert rank
            take = self.parts.pop if last else self.parts.__getitem__
            parts = [self._expert_slice(take((t, p, v)), e) for v in range(self.vp)]
            if self.vp == 1:
                body = {"model": nest(parts[0])}
            else:
                body = {f"model{v}": nest(parts[v]) for v in range(self.vp)}
            path = self._chunk_file(t, p, e)
            if self.with_optimizer:
                common = self.meta.extra["optimizer"]
                take_opt = self.opt_parts.pop if last else self.opt_parts.__getitem__
                opt = [self._expert_slice_entries(take_opt((t, p, v)), e) for v in range(self.vp)]
                body["optimizer"], param_state = ostate.distributed_files(opt, common, common["step"],
                                                                   common["state_keys"])
                dpath = os.path.join(os.path.dirname(path), "distrib_optim.pt")
                atomic_torch_save(param_state, dpath)
                files.append(dpath)
                del param_state
            sd = self._file_dict(body)
            rng = self.meta.extra.get("rng_states")  # per tensor rank (deepspeed_format): same layout only
            if rng and len(rng) == self.tp and self.pp == 1 and self.vp == 1 and self.ep == 1:
                sd["rng_state"] = rng[t]
            atomic_torch_save(sd, path)
            files.append(path)
            del body, parts  # unmaps the staged tensors of this rank file
        shutil.rmtree(self.staging, ignore_errors=True)
        return files

    def _file_dict(self, body: Dict[str, Any]) -> Dict[str, Any]:
        meta = self.meta
        arch = architecture_of(meta.config(padded_vocab_size=self.padded))
        sd: Dict[str, Any] = {
            "args": _saved_args(meta, self.tp, self.pp, self.vp_layers, self.padded, self.ep),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": 0 if self.iteration is None else self.iteration,
            "consumed_train_samples": meta.consumed_train_samples,
            "consumed_valid_samples": meta.consumed_valid_samples,
            "true_vocab_size": meta.true_vocab_size,
            "padded_vocab_size": self.padded,
            "architecture": arch,
        }
        if "consumed_tokens" in meta.extra:
            sd["consumed_train_tokens"], sd["consumed_valid_tokens"] = meta.extra["consumed_tokens"]
        sched = meta.extra.get("opt_param_scheduler")
        if sched is not None:
            sd["opt_param_scheduler"] = sched
            sd["lr_scheduler"] = sched
        sd.update(body)
        return sd


def write_megatron(meta: ModelMeta, messages: Iterator[Message], save_dir: str, tp: int = 1, pp: int = 1,
                   vp_layers: Optional[int] = None, ep: int = 1) -> List[str]:
    """Saver: write the stream as a Megatron checkpoint (TP `tp`, PP `pp`, optional virtual chunks, experts
    sharded over `ep` expert ranks)."""
    if registry.layout_for(meta.model_type).encoder_decoder:  # t5_format.write_t5 (which builds on this module)
        raise ConversionError(f"write_megatron writes GPT/BERT checkpoints: write {meta.model_type} ones with "
                              "t5_format.write_t5")
    return MegatronWriter(meta, save_dir, tp, pp, vp_layers, ep).write(messages)
