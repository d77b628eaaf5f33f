"""Which checkpoint layout a folder holds, and `--load` of today's Megatron-LM layouts into our models.

Three layouts load with ``--load``:
  * ``torch`` (ours): per-rank ``mp_rank_XX[_YYY]/model_optim_rng.pt`` with Megatron-LM 23.06's names; loaded by
    megatron/checkpoint/checkpointing.py at the layout that wrote it;
  * ``torch`` with Megatron Core names (Megatron-LM's ``--ckpt-format torch`` since Megatron Core): the same files,
    other parameter names (megatron/layers/mcore_names.py);
  * ``torch_dist`` (Megatron-LM's default): one `torch.distributed.checkpoint` folder of global tensors
    (megatron/checkpoint/conversion/torch_dist.py).
The last two load at any TP/PP/DP layout of this run, whatever layout wrote them: every rank reads the full (TP=1)
tensors (through the safe loader, and the manifest check when the folder has one), takes its pipeline stage's
layers and its tensor-parallel slice. A torch_dist folder's optimizer state in Megatron Core's model-space layout
(megatron/checkpoint/conversion/torch_dist_optim.py: what ``--ckpt-format torch_dist`` writes here, and Megatron-LM
with ``--dist-ckpt-optim-fully-reshardable``) is cut the same way into the run's optimizer, regular or distributed,
with the LR schedule and consumed samples, so training resumes at any layout; Megatron-LM's default ``dp_reshardable``
layout is first rebuilt in model space (torch_dist_buckets.py). The RNG state (Megatron-LM's ``rng_state``
ShardedObjects, which ``--ckpt-format torch_dist`` writes too, or the per TP x PP rank entry of ``common.pt`` older
saves of ours hold) is restored at the layout that saved it and ignored at another one, as Megatron-LM does. Megatron Core ``torch`` files' optimizer state is not converted (``--no-load-optim``, one line says so).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from megatron.checkpoint.args import compare_architecture, saved_architecture
from megatron.checkpoint.conversion.interchange import ConversionError, state_dict_from_messages
from megatron.checkpoint.conversion.megatron_format import (
    chunk_of_layer,
    dense_rank_files,
    expert_rank_files,
    rank_files,
    read_megatron,
)
from megatron.checkpoint.conversion.t5_format import read_t5
from megatron.checkpoint.conversion.torch_dist import (
    is_torch_dist,
    read_core_rng,
    read_iteration_state,
    write_torch_dist,
)
from megatron.checkpoint.conversion.torch_dist_optim import (
    incomplete_names,
    optimizer_common,
    optimizer_sd,
    param_state,
)
from megatron.checkpoint.conversion.vocab import repad_rows
from megatron.checkpoint.safe_load import safe_torch_load
from megatron.errors import MegatronUserError
from megatron.layers.mcore_names import core_to_ours, has_core_names
from megatron.layers.module import unwrap_model
from megatron.layers.tp_shards import (
    merge_tensor_parallel_state_dicts,
    split_tensor_parallel_state_dict,
    tensor_parallel_layouts,
)
from megatron.models import registry
from megatron.optimizer.distrib_optimizer import param_state_to_regular_state
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.training_state import RERUN_KEY, TOTALS, TrainingState

TORCH, CORE_TORCH, TORCH_DIST = "torch", "torch (Megatron Core names)", "torch_dist"
_LAYERS = "language_model.encoder.layers."
_T5_DEC = "language_model.decoder.layers."
_WORD = "language_model.embedding.word_embeddings.weight"
_OUT = "language_model.output_layer.weight"


class CheckpointFormatError(MegatronUserError, RuntimeError):
    """A checkpoint in a layout this run cannot load as asked (one line: the file or flag and the fix)."""


def _rank0_file(iter_dir: str) -> Optional[str]:
    for sub in ("mp_rank_00", "mp_rank_00_000"):
        for name in ("model_optim_rng.pt", "model_rng.pt"):
            path = os.path.join(iter_dir, sub, name)
            if os.path.isfile(path):
                return path
    return None


def detect_format(iter_dir: str, trust: bool = False) -> str:
    """TORCH, CORE_TORCH or TORCH_DIST for one iteration folder (TORCH when it cannot tell: ours reports that)."""
    if is_torch_dist(iter_dir):
        return TORCH_DIST
    path = _rank0_file(iter_dir)
    if path is None:
        return TORCH
    try:
        sd = safe_torch_load(path, map_location="cpu", trust=trust, mmap=True)
    except Exception:  # noqa: BLE001 - the regular loader reports a damaged file with its own message
        return TORCH
    model = sd.get("model", sd.get("model0")) if isinstance(sd, dict) else None
    return CORE_TORCH if isinstance(model, dict) and has_core_names(model) else TORCH


def check_format_flags(fmt: str, cfg: CheckpointSettings, iter_dir: str) -> None:
    """Megatron-LM's rule: a folder in another format than --ckpt-format loads only with --auto-detect-ckpt-format;
    says in one line which layout it found."""
    wanted = cfg.ckpt_format
    found = TORCH_DIST if fmt == TORCH_DIST else TORCH
    if found != wanted and not cfg.auto_detect_ckpt_format:
        raise CheckpointFormatError(f"checkpoint {iter_dir} is in the {found} format but --ckpt-format is {wanted}: "
                                    f"pass --auto-detect-ckpt-format (or --ckpt-format {found})")
    if fmt != TORCH and _is_rank0():
        print(f" detected checkpoint format {fmt} in {iter_dir}", flush=True)


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _read_core_torch_t5(iter_dir: str, trust: bool, layouts: Dict[str, Any], flags: Optional[Dict[str, Any]] = None
                        ) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, torch.Tensor]]:
    """Megatron Core T5Model's per-rank torch files (one pipeline stage, any TP) -> (common state, architecture, our
    full flat TP=1 state dict); `layouts`: our T5's tensor-parallel layouts by name; `flags`: the architecture of
    files that record none."""
    files = rank_files(iter_dir)
    if any(p for _, p in files):
        raise ConversionError(f"checkpoint {iter_dir}: Megatron Core T5 torch files of a pipeline (Megatron-LM <= "
                              "0.13's --encoder-pipeline-model-parallel-size) are not read here; save it from "
                              "Megatron-LM with --ckpt-format torch_dist, or with --pipeline-model-parallel-size 1")
    sds = [safe_torch_load(files[(t, 0)], map_location="cpu", trust=trust, mmap=True) for t in range(len(files))]
    shards = [core_to_ours(sd["model"]) for sd in sds]
    flat = merge_tensor_parallel_state_dicts(shards, layouts=layouts)
    common = {k: v for k, v in sds[0].items() if not k.startswith("model") and k not in ("optimizer", "rng_state")}
    arch = saved_architecture(common.get("architecture"), common.get("args"))
    if not arch.get("num_layers") and flags is not None:
        arch = dict(flags)
    arch["padded_vocab_size"] = int(flat["language_model.embedding.word_embeddings.weight"].size(0))
    return common, arch, flat


def read_full(iter_dir: str, load_dir: str, fmt: str, trust: bool, optimizer: bool = False, model_type: str = "GPT",
              layouts: Optional[Dict[str, Any]] = None, flags: Optional[Dict[str, Any]] = None
              ) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]:
    """(state besides the weights: args/iteration/..., architecture, our full flat TP=1 state dict, and with
    `optimizer` the optimizer state {state key: full flat dict} of a torch_dist folder, else {}); a T5 model's
    per-rank files need our model's TP `layouts`. `flags` (this run's architecture) stands in for the architecture
    of a checkpoint that records none (Megatron-LM loads those with its command-line flags). The caller has checked
    the folder against its manifest (checkpointing.py does before `load_foreign`)."""
    try:
        if fmt == TORCH_DIST:
            common, arch, flat, opt = read_iteration_state(iter_dir, trust, flags)
            return common, arch, flat, opt if optimizer else {}
        if optimizer:
            raise ConversionError(f"checkpoint {iter_dir} ({fmt}): Megatron Core's optimizer state in per-rank torch "
                                  "files is not converted; pass --no-load-optim")
        if registry.layout_for(model_type).encoder_decoder:  # Core's encoder-decoder: per-rank files merged here
            return (*_read_core_torch_t5(iter_dir, trust, layouts or {}, flags), {})
        iteration = None if os.path.basename(iter_dir) == "release" else int(os.path.basename(iter_dir)[5:])
        meta, messages = read_megatron(load_dir, trust=trust, iteration=iteration, model_type=model_type,
                                        flags=flags)
        flat = state_dict_from_messages(messages)
        # read_megatron cuts nothing without a true vocabulary size: the rows are the writer's padded ones
        first = _rank0_file(iter_dir)
        sd = safe_torch_load(first, map_location="cpu", trust=trust, mmap=True)
        common = {k: v for k, v in sd.items() if not k.startswith("model") and k not in ("optimizer", "rng_state")}
        return common, dict(meta.architecture), flat, {}
    except ConversionError as exc:
        raise CheckpointFormatError(str(exc)) from None


# ours until today's saves wrote Megatron-LM's rng_state ShardedObjects, in common.pt (still read):
RNG_KEY = "rng_state_by_rank"  # {"tp": T, "pp": P, "ranks": {(tp rank, pp rank): rng list}}


def rewrite_as_torch_dist(save_dir: str, iteration: int, iter_dir: str, optimizer: bool = True) -> None:
    """--ckpt-format torch_dist on save: turn the per-rank files of `iter_dir` (just written, any layout) into one
    torch_dist folder with Megatron Core names; common.pt keeps args, iteration, consumed samples and the LR schedule,
    each model-parallel rank's RNG state becomes Megatron-LM's ``rng_state`` ShardedObject; with `optimizer` the
    optimizer state goes along (fully_reshardable)."""
    try:
        ep, expert_files = expert_rank_files(iter_dir)  # expert parallelism: read_megatron merges the experts
        files = dense_rank_files(expert_files) if ep > 1 else rank_files(iter_dir)
        first = safe_torch_load(files[(0, 0)], map_location="cpu")
        last = first if len(files) == 1 else safe_torch_load(files[(0, max(p for _, p in files))], map_location="cpu")
        bert = any(k in ("lm_head", "binary_head") for k in last.get("model") or {})
        if "decoder" in ((last.get("model") or {}).get("language_model") or {}):  # T5
            meta, messages = read_t5(save_dir, iteration=iteration, optimizer=optimizer, verify=False)
        else:  # (verify=False: these files were just written and have no manifest yet; the save signs the result)
            meta, messages = read_megatron(save_dir, iteration=iteration, optimizer=optimizer,
                                           model_type="BERT" if bert else "GPT", verify=False)
        keep = ("consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens", "consumed_valid_tokens",
                "opt_param_scheduler", "true_vocab_size", "padded_vocab_size", "train_loss", *TOTALS, RERUN_KEY)
        extra = {k: first[k] for k in keep if k in first}
        rng = None
        if "rng_state" in first:  # Megatron-LM's rng_state ShardedObjects (older saves: RNG_KEY in common.pt)
            ranks = {tp_pp: safe_torch_load(path, map_location="cpu").get("rng_state") for tp_pp, path in files.items()}
            rng = {"tp": max(t for t, _ in files) + 1, "pp": max(p for _, p in files) + 1, "ranks": ranks}
        write_torch_dist(meta, messages, iter_dir, extra, rng=rng, rng_dp_axis=ep > 1)
    except ConversionError as exc:
        raise CheckpointFormatError(f"--ckpt-format torch_dist: {exc}") from None


_EXPERT_STACKS = (".mlp.experts.weight1", ".mlp.experts.weight2", ".mlp.experts.bias1", ".mlp.experts.bias2")


def rank_piece(full: Dict[str, torch.Tensor], own: Dict[str, torch.Tensor], model: torch.nn.Module,
               num_layers: int, chunk: int, state: Any, check: Optional[Tuple[str, bool]] = None
               ) -> Dict[str, torch.Tensor]:
    """This rank's part of a full flat state dict for one model chunk: its pipeline layers (renumbered), the
    vocabulary re-padded to the model's rows, its experts (expert parallelism), its tensor-parallel slice; only the
    names the chunk has. `check` = (checkpoint folder, exact rows): every tensor's shape is first checked against the
    model (`check_shapes`)."""
    vp = state.virtual_pp_size or 1
    piece: Dict[str, torch.Tensor] = {}
    t5 = _t5_stages(full, state) if state.pp_size > 1 and any(k.startswith(_T5_DEC) for k in full) else None
    for key, value in full.items():
        if t5 is not None and key.startswith((_LAYERS, _T5_DEC)):  # T5: each stack over its own stages
            stack = _LAYERS if key.startswith(_LAYERS) else _T5_DEC
            index, _, suffix = key[len(stack):].partition(".")
            first, per = t5[stack]
            stage, local = divmod(int(index), per)
            if first + stage == state.pp_rank:
                piece[f"{stack}{local}.{suffix}"] = value
        elif key.startswith(_LAYERS):
            index, _, suffix = key[len(_LAYERS):].partition(".")
            p, v, local = chunk_of_layer(int(index), num_layers, state.pp_size, vp)
            if (p, v) == (state.pp_rank, chunk):
                piece[f"{_LAYERS}{local}.{suffix}"] = value
        else:
            piece[key] = value
    if "word_embeddings.weight" in own and _WORD in full:  # the head's copy of tied embeddings (last stage)
        piece["word_embeddings.weight"] = full[_WORD]
    if check is not None:
        check_shapes(piece, own, model, state, *check)
    for key in (_WORD, _OUT, "word_embeddings.weight", "lm_head.bias"):
        if key in piece and key in own:
            piece[key] = repad_rows(piece[key], own[key].size(0) * state.tp_size)
    piece = {k: v for k, v in piece.items() if k in own}
    if (getattr(state, "ep_size", 1) or 1) > 1:  # expert parallelism: this rank's experts (dim 0 of the stacks)
        for key in [k for k in piece if k.endswith(_EXPERT_STACKS)]:
            n = own[key].size(0)
            piece[key] = piece[key][state.ep_rank * n:(state.ep_rank + 1) * n]
    experts = {}
    if getattr(state, "expert_tp_differs", False):  # --expert-tensor-parallel-size != TP: experts split over it
        experts = {k: piece.pop(k) for k in [k for k in piece if k.endswith(_EXPERT_STACKS)]}
        if state.etp_size > 1:
            experts = split_tensor_parallel_state_dict(experts, state.etp_size,
                                                       layouts=tensor_parallel_layouts(model))[state.etp_rank]
    if state.tp_size > 1:
        piece = split_tensor_parallel_state_dict(piece, state.tp_size, layouts=tensor_parallel_layouts(model))[
            state.tp_rank]
    return {**piece, **experts}


_VOCAB_ROWS = (_WORD, _OUT, "word_embeddings.weight", "lm_head.bias")
# (name ends with, dim) -> the flag that sets that size; (name ends with, None): any dim
_SHAPE_FLAGS = ((("position_embeddings.weight", 0), "--max-position-embeddings"),
                (("query_key_value.weight", 0), "--num-attention-heads, --kv-channels or --num-query-groups"),
                (("query_key_value.bias", 0), "--num-attention-heads, --kv-channels or --num-query-groups"),
                (("self_attention.dense.weight", 1), "--num-attention-heads or --kv-channels"),
                (("dense_h_to_4h.weight", 0), "--ffn-hidden-size (or --swiglu)"),
                (("dense_h_to_4h.bias", 0), "--ffn-hidden-size (or --swiglu)"),
                (("dense_4h_to_h.weight", 1), "--ffn-hidden-size (or --swiglu)"),
                (("mlp.experts.weight1", 0), "--num-experts"), (("mlp.experts.weight2", 0), "--num-experts"),
                (("mlp.experts.weight1", 2), "--moe-ffn-hidden-size (or --swiglu)"),
                (("mlp.experts.weight2", 1), "--moe-ffn-hidden-size"),
                (("mlp.router.weight", 0), "--num-experts"),
                (("tokentype_embeddings.weight", 0), "the number of token types (BERT: --bert-no-binary-head)"))


def _shape_flag(name: str, dim: int) -> str:
    """The flag that sets dimension `dim` of our tensor `name` (the hidden size where no other one does)."""
    if name in _VOCAB_ROWS and dim == 0:
        return "--vocab-size or --make-vocab-size-divisible-by (the tokenizer's vocabulary)"
    return next((flag for (suffix, d), flag in _SHAPE_FLAGS if name.endswith(suffix) and d == dim), "--hidden-size")


def check_shapes(piece: Dict[str, torch.Tensor], own: Dict[str, torch.Tensor], model: Any, state: Any, path: str,
                 exact_rows: bool) -> None:
    """Refuse, in one line naming the tensor, its shape in the checkpoint, the model's and the flag to fix, a full
    (TP=1) tensor that does not fit this rank's model (own shapes scaled back by TP and EP); the vocabulary rows are
    re-padded, so they are compared only with `exact_rows` (a checkpoint without args: its rows are the flags')."""
    tp = state.tp_size if not getattr(state, "expert_tp_differs", False) else None
    layouts = tensor_parallel_layouts(model) if model is not None and (state.tp_size > 1 or tp is None) else {}
    for name, value in piece.items():
        if name not in own or not isinstance(value, torch.Tensor):
            continue
        want = list(own[name].shape)
        expert = name.endswith(_EXPERT_STACKS)
        split = getattr(state, "etp_size", 1) if expert and tp is None else state.tp_size
        layout = layouts.get(name)
        if layout is not None and layout.dim is not None and split > 1 and len(want) > layout.dim:
            want[layout.dim] *= split
        if expert and (getattr(state, "ep_size", 1) or 1) > 1:
            want[0] *= state.ep_size
        have, skip = list(value.shape), int(name in _VOCAB_ROWS and not exact_rows)
        if have[skip:] != want[skip:]:
            dim = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b and i >= skip), skip)
            raise CheckpointFormatError(
                f"checkpoint {path}: {name} has shape {have} there but the model the flags build needs {want}: "
                f"check {_shape_flag(name, dim)}")


def _t5_stages(full: Dict[str, torch.Tensor], state: Any) -> Dict[str, Tuple[int, int]]:
    """{layer prefix: (first stage, layers per stage)} of a T5 model's encoder and decoder stacks under Megatron
    23.06's split rank R (encoder layers over stages 0..R-1, decoder layers over R..P-1, numbered from 0 per stage)."""
    split, pp = state.pipeline_split_rank, state.pp_size
    if split is None or not 0 < split < pp:
        raise CheckpointFormatError(f"a T5 pipeline of {pp} stages needs --pipeline-model-parallel-split-rank in "
                                    f"1..{pp - 1}")
    out = {}
    for stack, first, stages in ((_LAYERS, 0, split), (_T5_DEC, split, pp - split)):
        count = len({k[len(stack):].partition(".")[0] for k in full if k.startswith(stack)})
        if count % stages:
            what = "encoder" if stack == _LAYERS else "decoder"
            raise CheckpointFormatError(f"the checkpoint's {count} {what} layers do not split evenly over {stages} "
                                        f"{what} pipeline stage(s): choose --pipeline-model-parallel-split-rank to "
                                        "match")
        out[stack] = (first, count // stages)
    return out


def _load_optimizer_state(optimizer: Any, models: List[Any], opt_full: Dict[str, Dict[str, torch.Tensor]],
                          opt_common: Dict[str, Any], num_layers: int, state: Any) -> None:
    """Cut the full optimizer state to this rank (as the weights) and load it into the run's optimizer."""
    chunks = []
    for i, chunk in enumerate(models):
        model = unwrap_model(chunk)
        own = model.state_dict()
        pieces = {key: rank_piece(full, own, model, num_layers, i, state) for key, full in opt_full.items()}
        entries = {}
        for name, _ in model.named_parameters():
            missing = [key for key, piece in pieces.items() if name not in piece]
            if missing and incomplete_names({key: {name: None} if name in piece else {}
                                             for key, piece in pieces.items()}):  # (Muon's state: momentum or moments)
                raise CheckpointFormatError(f"the checkpoint has no optimizer {missing[0]} for {name}; pass "
                                            "--no-load-optim")
            entries[name] = {key: piece[name].float() for key, piece in pieces.items() if name in piece}
        chunks.append(entries)
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside ours
    try:
        body, common = param_state(chunks, opt_common), optimizer_sd(opt_common, inner.param_groups)
        if hasattr(optimizer, "load_parameter_state"):
            optimizer.load_state_dict(common)
            optimizer.load_parameter_state(body)
        else:
            optimizer.load_state_dict(param_state_to_regular_state(body, common, models, optimizer))
    except (ValueError, KeyError) as exc:
        raise CheckpointFormatError(f"cannot load the optimizer state of the torch_dist checkpoint: {exc}") from None


def saved_rng(common: Dict[str, Any], iter_dir: str, state: Any, trust: bool = False) -> Optional[List[Any]]:
    """This rank's RNG state list (from common.pt, or Megatron-LM's ``rng_state`` in a torch_dist folder) at the layout
    that saved it; None (with a note) at another one."""
    saved = common.get(RNG_KEY)
    if not isinstance(saved, dict) and os.path.isfile(os.path.join(iter_dir, ".metadata")):
        try:
            saved = read_core_rng(iter_dir, trust)  # Megatron-LM's own
        except ConversionError as exc:
            raise CheckpointFormatError(str(exc)) from None
    if not isinstance(saved, dict):
        raise CheckpointFormatError(f"checkpoint {iter_dir} has no RNG state this code reads; pass --no-load-rng")
    if (saved.get("tp"), saved.get("pp")) != (state.tp_size, state.pp_size):
        if _is_rank0():
            print(f" (TP, PP) mismatch after resume ({(saved.get('tp'), saved.get('pp'))} vs "
                  f"{(state.tp_size, state.pp_size)} from checkpoint): RNG state will be ignored", flush=True)
        return None
    return saved["ranks"][(state.tp_rank, state.pp_rank)]


def _full_layouts(model: Any, family: Any) -> Dict[str, Any]:
    """The TP layouts by name of the whole (TP=1, unpipelined) model of `model`'s config, as its family's checkpoint
    layout builds it on the meta device (a pipeline stage has only its own layers, but a per-rank file's merge needs
    every one)."""
    config = dataclasses.replace(model.config, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 sequence_parallel=False)
    return tensor_parallel_layouts(family.layout_model(config, {}))


def check_layer_counts(full: Dict[str, torch.Tensor], architecture: Mapping[str, Any], path: str) -> None:
    """A checkpoint without args holds as many layers (T5: encoder and decoder layers) as the flags say, or one line
    names the flag and the checkpoint's count."""
    decoder = any(k.startswith(_T5_DEC) for k in full)
    stacks = ((_LAYERS, "encoder_num_layers" if decoder else "num_layers"), (_T5_DEC, "decoder_num_layers"))
    for prefix, field in stacks:
        count = len({k[len(prefix):].partition(".")[0] for k in full if k.startswith(prefix)})
        want = architecture.get(field) or architecture.get("num_layers")
        if count and want and count != want:
            flag = "--num-layers" if field == "num_layers" else "--" + field.replace("_", "-")
            raise CheckpointFormatError(f"checkpoint {path} records no args and holds {count} layers "
                                        f"({prefix}N) but the flags give {field}={want}: pass {flag} {count}")


def load_foreign(models: List[Any], cfg: CheckpointSettings, architecture: Mapping[str, Any], load_dir: str,
                 iter_dir: str, fmt: str, release: bool, state: Any, run: TrainingState, optimizer: Any = None,
                 opt_param_scheduler: Any = None,
                 on_restored: Optional[Callable[[TrainingState, Tuple[str, ...]], None]] = None
                 ) -> Tuple[int, Dict[str, Any], Optional[List[Any]]]:
    """Load a Megatron Core checkpoint into `models` (and, resuming from a torch_dist folder, `optimizer` and
    `opt_param_scheduler`); returns (iteration to continue from, common state, this rank's RNG state list to restore
    or None). The checkpoint's architecture is checked against `architecture` (this run's); the consumed samples go
    to `run` (then ``on_restored(run, names)``)."""
    resume = not (cfg.finetune or release)
    load_optim = resume and optimizer is not None and not cfg.no_load_optim
    load_rng = resume and not cfg.no_load_rng
    if fmt != TORCH_DIST and (load_optim or load_rng):
        raise CheckpointFormatError(f"checkpoint {iter_dir} ({fmt}): its optimizer and RNG state are not converted; "
                                    "pass --finetune, or --no-load-optim --no-load-rng")
    trust = cfg.trust_checkpoint
    first = unwrap_model(models[0])
    family = registry.layout_of_model(first)  # megatron/models/<family>/checkpoint_layout.py
    model_type = family.model_type
    layouts = _full_layouts(first, family) if family.encoder_decoder else None
    common, arch, full, opt_full = read_full(iter_dir, load_dir, fmt, trust, optimizer=load_optim,
                                             model_type=model_type, layouts=layouts, flags=dict(architecture))
    recorded = bool(saved_architecture(common.get("architecture"), common.get("args")).get("num_layers"))
    if not recorded:  # a Core checkpoint without args: the flags' architecture, its layer counts checked here
        check_layer_counts(full, architecture, iter_dir)
    compare_architecture({k: v for k, v in arch.items() if k != "padded_vocab_size"}, architecture, iter_dir)
    opt_common = None
    if load_optim:
        try:
            opt_common = optimizer_common(common, opt_full, f"checkpoint {iter_dir}")
        except ConversionError as exc:
            raise CheckpointFormatError(str(exc)) from None
    for i, chunk in enumerate(models):
        model = unwrap_model(chunk)
        own = model.state_dict()
        piece = rank_piece(full, own, model, int(arch["num_layers"]), i, state, (iter_dir, not recorded))
        missing = sorted(set(own) - set(piece) - {k for k in own if k.endswith("_extra_state")})
        if missing:
            raise CheckpointFormatError(f"checkpoint {iter_dir} ({fmt}) has no {missing[0]} for this model; check "
                                        "--num-layers, --untie-embeddings-and-output-weights and the model flags")
        model.load_state_dict(piece, strict=False)
    if not resume:
        if optimizer is not None and hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()
        return 0, common, None
    if opt_common is not None:
        _load_optimizer_state(optimizer, models, opt_full, opt_common, int(arch["num_layers"]), state)
        if opt_param_scheduler is not None and common.get("opt_param_scheduler") is not None:
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 main params follow the loaded weights
    rng = saved_rng(common, iter_dir, state, trust) if load_rng else None
    ckpt_args = common.get("args")
    names = tuple(k for k in ("consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens",
                              "consumed_valid_tokens") if k in common or k.endswith("samples"))
    for key in names:
        setattr(run, key, int(common.get(key, getattr(ckpt_args, key, 0)) or 0))
    for key in TOTALS:  # the run's skipped/non-finite totals (ours; absent: 0)
        setattr(run, key, int(common.get(key, 0)))
    run.rerun_state = common.get(RERUN_KEY)  # a step to re-run from this checkpoint (--rerun-mode)
    run.skipped_train_samples = int(getattr(ckpt_args, "skipped_train_samples", 0) or 0)  # --iterations-to-skip
    if on_restored is not None:
        on_restored(run, names)
    return int(common.get("iteration", getattr(ckpt_args, "iteration", 0)) or 0), common, rng
