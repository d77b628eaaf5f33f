"""Training state in checkpoint conversion: resume a run on another TP x PP x DP layout (GPT, BERT and T5 models).

Reading: the optimizer state of every (tensor, pipeline) rank file of a Megatron checkpoint becomes per-parameter
entries ``{"param": fp32 main param, "exp_avg", "exp_avg_sq"}`` keyed by the parameter's flat name in that rank's
model chunk, from either optimizer:

- the regular optimizer (``model_optim_rng.pt``'s ``optimizer``: torch's state dict whose integer indices follow
  `megatron.optimizer.param_groups.get_param_groups` over the rank's chunks, plus ``fp32_from_fp16_params`` with
  --fp16/--bf16), mapped to names with `regular_param_order` (the stage's parameter order is that of the TP=1 model
  built on the meta device, restricted to the stage: TP does not change names, shapes' ranks or order);
- the distributed optimizer (``distrib_optim.pt``: already full per-parameter state of the model-parallel rank).

The megatron loader merges these over TP ranks with each parameter's own TP layout (as it merges the weights) and
sends them with the weights (`Message.optimizer`); the megatron saver splits them for the target layout and writes
them in the distributed optimizer's data-parallel-independent form (``distrib_optim.pt`` per TP x PP rank, the
common part in ``model_optim_rng.pt``), which ``--load`` reads with ``--use-distributed-optimizer`` at any DP size and
converts for the regular optimizer (megatron/checkpoint/checkpointing.py).

Vocabulary padding: with the training state the padded rows of the word embedding / output layer are kept exactly
as trained, weights and moments. They are not inert: their logits take part in the softmax, so they get gradients
and Adam updates; dropping them and re-padding (repeating the last row) would change the continuation. The curve
after conversion therefore equals the original's when the padded vocabulary is the same at both TP sizes (choose
--make-vocab-size-divisible-by so); when it is not, missing rows repeat the last row's weights *and* moments (a
twin of that row: zero moments would make the first Adam update of those rows about 1/sqrt(1-beta2) ~ 30x a normal
step), and extra rows are cut.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Sequence, Tuple

import torch

from megatron.checkpoint.conversion.interchange import ConversionError
from megatron.checkpoint.conversion.vocab import repad_rows
from megatron.optimizer.distrib_optimizer import PARAM_STATE_FORMAT
from megatron.optimizer.muon import split_muon_groups

PARAM = "param"
_LAYER_RE = re.compile(r"^language_model\.(encoder|decoder)\.layers\.(\d+)\.(.+)$")
HEAD_COPY = "word_embeddings.weight"
_LM = "language_model."

OptEntries = Dict[str, Dict[str, torch.Tensor]]  # {flat parameter name: {"param", "exp_avg", ...}}


class ForeignOptimizerState(ConversionError):
    """An optimizer state in a layout this converter does not map (another framework's); the loader converts the
    weights only and says so, as before training states were converted."""


def stage_order(names: Sequence[str], full_order: Sequence[str]) -> List[str]:
    """The parameters among `names` (a stage's flat names, local layer numbers) in ``named_parameters()`` order of
    that stage's model: embeddings, each layer stack (the encoder; T5's decoder too) by local layer index followed
    by its final norm, output layer (GPT) or pooler (BERT), the last stage's copy of the tied embedding (registered
    after the language model), then the heads outside it (BERT's ``lm_head`` and ``binary_head``, T5's
    ``lm_head``). `full_order`: the TP=1 model's parameter names in order."""
    position = {n: i for i, n in enumerate(full_order)}
    # a layer's parameter sorts at its stack's first position, then by local layer, then by its layer-0 name
    stack_start: Dict[str, int] = {}
    for n, i in position.items():
        m = _LAYER_RE.match(n)
        if m:
            stack_start.setdefault(m.group(1), i)
    # the tied embedding's copy sits between the language model and the first parameter outside it (the heads)
    head_copy = min((i for n, i in position.items() if not n.startswith(_LM)), default=len(full_order)) - 0.5
    # within a layer, by the name's offset in the first full-model layer holding it (layers may differ: an MoE
    # model's dense and MoE layers hold different MLP parameters)
    layer_first: Dict[Tuple[str, str], int] = {}
    offset: Dict[Tuple[str, str], int] = {}
    for n, i in position.items():
        m = _LAYER_RE.match(n)
        if m:
            first = layer_first.setdefault((m.group(1), m.group(2)), i)
            offset.setdefault((m.group(1), m.group(3)), i - first)
    keyed = []
    for name in names:
        m = _LAYER_RE.match(name)
        if m:
            suffix = (m.group(1), m.group(3))
            if suffix in offset:
                keyed.append(((stack_start[m.group(1)], int(m.group(2)), offset[suffix]), name))
        elif name == HEAD_COPY:
            keyed.append(((head_copy, 0, 0), name))
        elif name in position:
            keyed.append(((position[name], 0, 0), name))
    return [name for _, name in sorted(keyed)]


def regular_param_order(chunks: Sequence[Dict[str, Any]], full_order: Sequence[str]) -> List[List[Tuple[int, str]]]:
    """[(chunk, name), ...] per param group of the regular optimizer of one rank, as
    `megatron.optimizer.param_groups.get_param_groups` builds them (weight decay on tensors of rank >= 2 that are
    not biases, then the rest; empty groups dropped)."""
    buckets: Dict[bool, List[Tuple[int, str]]] = {True: [], False: []}
    for c, flat in enumerate(chunks):
        for name in stage_order(list(flat), full_order):
            no_wd = name.endswith(".bias") or flat[name].dim() == 1
            buckets[not no_wd].append((c, name))
    return [b for b in (buckets[True], buckets[False]) if b]


def muon_param_order(groups: List[List[Tuple[int, str]]], chunks: Sequence[Dict[str, Any]],
                     saved: List[Dict[str, Any]]) -> List[List[Tuple[int, str]]]:
    """The regular order `groups` split as --optimizer muon splits its groups (megatron/optimizer/muon.py: Muon
    groups first, by weight decay, QKV split and expert; then the Adam ones), given the saved groups' QKV split."""
    qkv = next((tuple(g["qkv_split"]) for g in saved if g.get("qkv_split")), None)
    names: Dict[int, Tuple[int, str]] = {}
    plain = []
    for g, group in enumerate(groups):
        tensors = []
        for c, name in group:
            tensors.append(chunks[c][name])
            names[id(tensors[-1])] = (c, name)
        plain.append({"params": tensors, "wd_mult": float(g), "lr_mult": 1.0})  # distinct per regular group
    split = split_muon_groups(plain, {i: name for i, (_, name) in names.items()}, qkv)
    return [[names[id(t)] for t in group["params"]] for group in split]


def _inner(optim_sd: Dict[str, Any]) -> Dict[str, Any]:
    """torch's optimizer state dict inside a regular optimizer entry (FP32Optimizer: itself; fp16/bf16: 'optimizer')."""
    if "param_groups" in optim_sd:
        return optim_sd
    inner = optim_sd.get("optimizer", optim_sd.get("optimizer_state_dict"))
    if not isinstance(inner, dict) or "param_groups" not in inner:
        raise ConversionError("the checkpoint's optimizer entry is not a Megatron optimizer state; pass --no-save-optim "
                              "to convert the weights only")
    return inner


def has_training_state(optim_sd: Any) -> bool:
    """True when a rank file's ``optimizer`` entry holds state worth carrying (a distributed optimizer, or a
    regular one that stepped at least once)."""
    if not isinstance(optim_sd, dict):
        return False
    if optim_sd.get("distributed_optimizer"):
        return True
    try:
        return bool(_inner(optim_sd).get("state"))
    except ConversionError:
        return False


def regular_entries(optim_sd: Dict[str, Any], chunks: Sequence[Dict[str, Any]], full_order: Sequence[str],
                    where: str, ours: bool = True) -> Tuple[List[OptEntries], float, List[str]]:
    """Per-chunk entries of a regular optimizer's state (see the module docstring); (entries, step, state keys).
    `ours`: the file was written by this framework (else a group layout it does not know is ForeignOptimizerState)."""
    inner = _inner(optim_sd)
    groups = regular_param_order(chunks, full_order)
    saved = inner["param_groups"]
    if any(g.get("muon") for g in saved):
        groups = muon_param_order(groups, chunks, saved)
    if [len(g["params"]) for g in saved] != [len(g) for g in groups]:
        error = ConversionError if ours else ForeignOptimizerState
        raise error(f"{where}: the optimizer has param groups of {[len(g['params']) for g in saved]} parameters but "
                    f"the model files give {[len(g) for g in groups]}" + (": mismatched shards" if ours else ""))
    main = optim_sd.get("fp32_from_fp16_params", optim_sd.get("fp32_from_fp16")) if "param_groups" not in optim_sd \
        else None
    out: List[OptEntries] = [{} for _ in chunks]
    step, keys = 0.0, set()
    for g, (saved_group, names) in enumerate(zip(saved, groups)):
        if "step" in saved_group:  # apex FusedAdam (Megatron-LM checkpoints): the step count is per group
            step = max(step, float(saved_group["step"]))
        for i, (index, (c, name)) in enumerate(zip(saved_group["params"], names)):
            weight = chunks[c][name]
            value = main[g][i] if main else weight
            entry = {PARAM: value.float()}
            for k, v in inner["state"].get(index, {}).items():
                if k == "step":
                    step = max(step, float(v))
                elif torch.is_tensor(v) and v.dim() > 0:
                    entry[k] = v.float()
                    keys.add(k)
            for k, v in entry.items():
                if v.shape != weight.shape:
                    raise ConversionError(f"{where}: optimizer {k} of {name} has shape {tuple(v.shape)}, the weight "
                                          f"{tuple(weight.shape)}: mismatched shards")
            out[c][name] = entry
    return out, step, sorted(keys)


def distributed_entries(param_state: Dict[str, Any], chunks: Sequence[Dict[str, Any]], where: str
                        ) -> Tuple[List[OptEntries], float, List[str]]:
    """Per-chunk entries of a ``distrib_optim.pt`` (already full per parameter)."""
    if not isinstance(param_state, dict) or param_state.get("format") != PARAM_STATE_FORMAT:
        raise ForeignOptimizerState(f"{where} is not a distributed optimizer state of this framework")
    saved = param_state["chunks"]
    if len(saved) != len(chunks):
        raise ConversionError(f"{where} holds {len(saved)} model chunks, the model file {len(chunks)}: mismatched "
                              "shards")
    out: List[OptEntries] = []
    for c, flat in enumerate(chunks):
        entries: OptEntries = {}
        for name, entry in saved[c].items():
            if name not in flat or entry[PARAM].shape != flat[name].shape:
                raise ConversionError(f"{where}: state of {name} does not match the model file: mismatched shards")
            entries[name] = {k: v.float() for k, v in entry.items()}
        out.append(entries)
    return out, float(param_state.get("step", 0.0)), list(param_state.get("state_keys", []))


def common_part(optim_sd: Dict[str, Any]) -> Dict[str, Any]:
    """The layout-independent part: param-group hyperparameters (without their param lists) and the grad scaler."""
    inner = optim_sd["optimizer"] if optim_sd.get("distributed_optimizer") else _inner(optim_sd)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.get("param_groups", [])]
    out: Dict[str, Any] = {"param_groups": groups}
    if optim_sd.get("grad_scaler") is not None:
        out["grad_scaler"] = optim_sd["grad_scaler"]
    return out


def resize_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Vocabulary rows of a weight or moment for the target padding (see the module docstring)."""
    return repad_rows(t, rows)


def distributed_files(entries_per_chunk: List[OptEntries], common: Dict[str, Any], step: float,
                      state_keys: List[str]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the ``optimizer`` entry of ``model_optim_rng.pt``, the ``distrib_optim.pt`` body) of one target rank."""
    groups = [dict(g, params=[]) for g in common.get("param_groups", [])]
    optimizer: Dict[str, Any] = {"distributed_optimizer": True, "optimizer": {"param_groups": groups, "state": {}}}
    if common.get("grad_scaler") is not None:
        optimizer["grad_scaler"] = common["grad_scaler"]
    body = {"format": PARAM_STATE_FORMAT, "step": step, "state_keys": list(state_keys),
            "chunks": entries_per_chunk, "saved_data_parallel_size": None}
    return optimizer, body


# ---------------------------------------------------------------------------------------------- DeepSpeed ZeRO 1/2
_ZERO_OPTIM_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def zero_entries(tag_dir: str, tp_rank: int, chunk: Dict[str, Any], param_shapes: List[Dict[str, Any]],
                 load: Any) -> Tuple[OptEntries, float, List[str], Dict[str, Any]]:
    """Per-parameter entries of tensor rank `tp_rank` of a DeepSpeed ZeRO stage 1/2 checkpoint (non-pipeline engine):
    each data-parallel rank's ``zero_pp_rank_{d}_mp_rank_{tp:02d}_optim_states.pt`` holds, per param group, an equal
    slice of the group's flat fp32 params (``single_partition_of_fp32_groups``) and of the flat Adam moments
    (``base_optimizer_state``); concatenated over the ranks they split by the model file's ``param_shapes`` in order
    (with DeepSpeed's per-parameter alignment paddings), as DeepSpeed's zero_to_fp32 does for the weights. Holds
    this tensor rank's state in memory (DeepSpeed's flat layout has no per-layer access).
    Returns (entries, step, state keys, common part)."""
    files = {}
    for name in os.listdir(tag_dir):
        m = _ZERO_OPTIM_RE.match(name)
        if m and int(m.group(2)) == tp_rank:
            files[int(m.group(1))] = os.path.join(tag_dir, name)
    if not files:
        raise ConversionError(f"{tag_dir} has no zero_pp_rank_*_mp_rank_{tp_rank:02d}_optim_states.pt: no ZeRO "
                              "optimizer state to convert; pass --no-save-optim to convert the weights only")
    if sorted(files) != list(range(len(files))):
        missing = min(set(range(max(files) + 1)) - set(files))
        path = os.path.join(tag_dir, f"zero_pp_rank_{missing}_mp_rank_{tp_rank:02d}_optim_states.pt")
        raise ConversionError(f"missing rank file {path}; the checkpoint is incomplete")
    states = [load(files[d])["optimizer_state_dict"] for d in range(len(files))]
    first = states[0]
    counts = first.get("partition_count") or [len(files)]
    dp = int(counts[0] if isinstance(counts, (list, tuple)) else counts)
    if dp > len(files):
        path = os.path.join(tag_dir, f"zero_pp_rank_{len(files)}_mp_rank_{tp_rank:02d}_optim_states.pt")
        raise ConversionError(f"missing rank file {path} (ZeRO partitions over {dp} data-parallel ranks); the "
                              "checkpoint is incomplete")
    stage = int(getattr(first.get("zero_stage"), "value", first.get("zero_stage", 0)) or 0)
    if stage not in (1, 2) or "single_partition_of_fp32_groups" not in first:
        raise ConversionError(f"{files[0]}: ZeRO stage {stage} optimizer states are not converted (stages 1 and 2 "
                              "are); pass --no-save-optim to convert the weights only")
    if len(param_shapes) != len(first["single_partition_of_fp32_groups"]):
        raise ConversionError(f"{files[0]} has {len(first['single_partition_of_fp32_groups'])} param groups, the "
                              f"model file's param_shapes {len(param_shapes)}: mismatched shards")
    paddings = first.get("param_alignment_paddings")
    out: OptEntries = {}
    step, keys = 0.0, set()
    for g, shapes in enumerate(param_shapes):
        flat = {PARAM: torch.cat([s["single_partition_of_fp32_groups"][g].float() for s in states])}
        group_state = [s["base_optimizer_state"]["state"].get(g, {}) for s in states]
        for k, v in group_state[0].items():
            if k == "step":
                step = max(step, float(v))
            elif torch.is_tensor(v) and v.dim() > 0:
                flat[k] = torch.cat([gs[k].float() for gs in group_state])
                keys.add(k)
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = int(torch.Size(shape).numel())
            if name not in chunk or tuple(chunk[name].shape) != tuple(shape):
                raise ConversionError(f"{files[0]}: {name} of param_shapes is not a parameter of the model file: "
                                      "mismatched shards")
            if offset + numel > flat[PARAM].numel():
                raise ConversionError(f"{files[0]}: the flat optimizer partitions are shorter than param_shapes: "
                                      "mismatched shards (a missing data-parallel rank file?)")
            out[name] = {k: v.narrow(0, offset, numel).view(tuple(shape)).clone() for k, v in flat.items()}
            offset += numel + (int(paddings[g][i]) if paddings else 0)
        del flat
    base_groups = first["base_optimizer_state"].get("param_groups", [])
    common: Dict[str, Any] = {"param_groups": [{k: v for k, v in grp.items() if k != "params"} for grp in base_groups]}
    return out, step, sorted(keys), common


def attach_zero_state(reader: Any, load: Any) -> None:
    """Fill ``reader.opt`` / ``reader.opt_common`` (megatron_format's reader interface) of a DeepSpeed tag folder read
    as one pipeline stage per tensor rank (non-pipeline engine, ZeRO 1/2); nothing when it has no ZeRO files."""
    names = os.listdir(reader.iter_dir)
    if not any(_ZERO_OPTIM_RE.match(n) for n in names):
        return
    reader.opt, steps, keys, common = {}, set(), set(), {}
    for t in range(reader.tp):
        model_file = os.path.join(reader.iter_dir, f"mp_rank_{t:02d}_model_states.pt")
        shapes = (reader.first if t == 0 else load(model_file)).get("param_shapes")
        if not shapes:
            raise ForeignOptimizerState(f"{model_file} has no param_shapes (needed to read the ZeRO partitions)")
        entries, step, k, common_t = zero_entries(reader.iter_dir, t, reader.chunks[(t, 0, 0)], shapes, load)
        reader.opt[(t, 0, 0)] = entries
        steps.add(step)
        keys.update(k)
        common = common or common_t
    reader.opt_common = dict(common, step=max(steps), state_keys=sorted(keys))
