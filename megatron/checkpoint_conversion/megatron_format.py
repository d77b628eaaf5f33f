"""Megatron checkpoints (``latest_checkpointed_iteration.txt``, ``iter_N``/``release``, ``mp_rank_TT[_PPP]``) as a
conversion loader and saver, at any tensor / pipeline / virtual-pipeline layout.

Reading opens every rank file memory-mapped through the safe loader (weights-only + allow-list) and merges one
layer at a time with the parameters' own TP layouts (megatron.model.tp_shards), so the resident memory stays about one
layer plus the embeddings. QKV rows of checkpoint_version 0 ([3, heads, d]) and 1.0 ([heads, d, 3]) are reordered
to the current [heads, 3, d]. Writing splits each layer for the target TP, groups layers into the target's pipeline
stages / virtual chunks (Megatron's layer offsets), pads the vocabulary for the target TP (repeating the last row,
output layer too) and writes Megatron's files with ``args``, ``architecture``, ``checkpoint_version`` 3.0 and the
iteration (no optimizer or RNG state; load with --finetune or --no-load-optim --no-load-rng).
"""
from __future__ import annotations

import argparse
import copy
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.atomic_io import atomic_torch_save, atomic_write_text
from megatron.checkpoint_conversion.interchange import (
    EMBEDDINGS,
    FINAL_NORM,
    OUTPUT_LAYER,
    ConversionError,
    Message,
    ModelMeta,
    args_namespace,
    expect,
    layer_message,
)
from megatron.checkpoint_conversion.qkv_versions import fix_qkv_ordering
from megatron.checkpoint_conversion.vocab import repad_rows, target_rows
from megatron.core.tensor_parallel.layout import REPLICATED, TensorParallelLayout
from megatron.safe_load import CheckpointFileError, UnsafeCheckpointError, safe_torch_load

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
LM = "language_model."
ENC = LM + "encoder."
LAYERS = ENC + "layers."
WORD = LM + "embedding.word_embeddings.weight"
POS = LM + "embedding.position_embeddings.weight"
OUT = LM + "output_layer.weight"
HEAD_COPY = "word_embeddings.weight"
TOKENTYPE = LM + "embedding.tokentype_embeddings.weight"
# last-stage parts after the final norm: (flat name prefix, message name); BERT's pooler and heads
HEAD_PARTS = ((LM + "output_layer.", OUTPUT_LAYER), (LM + "pooler.", "pooler"), ("lm_head.", "lm head"),
              ("binary_head.", "binary head"))
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
    bert = meta.extra.get("bert") if meta.model_type == "BERT" else None
    key = tuple(sorted((k, v) for k, v in arch.items() if isinstance(v, (bool, int, float, str, type(None)))))
    key += (meta.model_type, tuple(sorted((bert or {}).items())))
    if key not in _LAYOUT_CACHE:
        config = meta.config(padded_vocab_size=arch["padded_vocab_size"])
        if bert is None:
            from megatron.model.tp_shards import tensor_parallel_layouts

            _LAYOUT_CACHE[key] = tensor_parallel_layouts(config)
        else:
            from megatron.core.tensor_parallel.layout import get_tp_layout
            from megatron.model.bert_model import BertModel

            with torch.device("meta"):
                model = BertModel(config, num_tokentypes=bert["num_tokentypes"],
                                  add_binary_head=bert["add_binary_head"])
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
def find_iteration_dir(load_dir: str) -> Tuple[str, Optional[int]]:
    """(iteration folder, iteration or None for ``release``) named by the tracker file."""
    if not os.path.isdir(load_dir):
        raise ConversionError(f"--load-dir {load_dir} does not exist")
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        hint = ""
        if os.path.isfile(os.path.join(load_dir, "latest")):
            hint = " (it looks like a DeepSpeed checkpoint: use --loader deepspeed)"
        elif os.path.isfile(os.path.join(load_dir, "config.json")):
            hint = " (it looks like a Hugging Face model: use --loader hf)"
        raise ConversionError(f"--load-dir {load_dir} is not a Megatron checkpoint: no {TRACKER}{hint}")
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return os.path.join(load_dir, "release"), None
    try:
        iteration = int(text)
    except ValueError:
        raise ConversionError(f"{tracker} holds {text!r}, not an iteration number or 'release'") from None
    return os.path.join(load_dir, f"iter_{iteration:07d}"), iteration


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


def _load(path: str, trust: bool) -> Dict[str, Any]:
    try:
        sd = safe_torch_load(path, map_location="cpu", trust=trust, mmap=True)
    except (CheckpointFileError, UnsafeCheckpointError):
        raise
    except Exception:  # noqa: BLE001 - an old (non-zip) file cannot be memory-mapped: read it normally
        sd = safe_torch_load(path, map_location="cpu", trust=trust)
    if not isinstance(sd, dict):
        raise ConversionError(f"{path} is not a Megatron checkpoint file (a {type(sd).__name__}, not a dict)")
    return sd


def _architecture_from(sd: Dict[str, Any], path: str) -> Dict[str, Any]:
    from megatron.checkpoint_args import saved_architecture

    arch = saved_architecture(sd.get("architecture"), sd.get("args"))
    args = sd.get("args")
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if key not in arch and getattr(args, key, None) is not None:
            arch[key] = getattr(args, key)
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if arch.get(k) is None]
    if missing:
        raise ConversionError(f"{path} stores neither 'architecture' nor args with {', '.join(missing)}: "
                              "not a checkpoint this tool can describe")
    return arch


class MegatronCheckpointReader:
    """The files of one Megatron checkpoint iteration, memory-mapped, with per-layer merging."""

    def __init__(self, load_dir: str, trust: bool = False) -> None:
        self.load_dir = load_dir
        self.iter_dir, self.iteration = find_iteration_dir(load_dir)
        self.files = rank_files(self.iter_dir)
        self.tp = max(t for t, _ in self.files) + 1
        self.pp = max(p for _, p in self.files) + 1
        self.trust = trust
        first = _load(self.files[(0, 0)], trust)
        self.first = first
        if not any(k == "model" or re.fullmatch(r"model\d+", k) for k in first):
            raise ConversionError(f"{self.files[(0, 0)]} has no 'model' entry: not a Megatron model checkpoint")
        self.vp = sum(1 for k in first if re.fullmatch(r"model\d+", k)) or 1
        self.version = float(first.get("checkpoint_version", 0) or 0)
        self.architecture = _architecture_from(first, self.files[(0, 0)])
        # {(tp, pp, vp): flat state dict}
        self.chunks: Dict[Tuple[int, int, int], Dict[str, Any]] = {}
        self._open()

    def _open(self) -> None:
        from megatron.model.gpt_model import flatten_checkpoint_state_dict

        for (t, p), path in sorted(self.files.items()):
            sd = self.first if (t, p) == (0, 0) else _load(path, self.trust)
            keys = ["model"] if self.vp == 1 else [f"model{v}" for v in range(self.vp)]
            for v, key in enumerate(keys):
                if key not in sd:
                    raise ConversionError(f"{path} has no '{key}' entry: its virtual pipeline chunks differ from "
                                          f"{self.files[(0, 0)]} (mismatched shards)")
                self.chunks[(t, p, v)] = flatten_checkpoint_state_dict(sd[key])
        for (t, p, v), flat in self.chunks.items():
            ref = self.chunks[(0, p, v)]
            if set(flat) != set(ref):
                diff = sorted(set(flat) ^ set(ref))[:2]
                raise ConversionError(f"{self.files[(t, p)]} and {self.files[(0, p)]} hold different parameters "
                                      f"({', '.join(diff)}): mismatched shards")
        counts = [self._layers_in(p, v) for v in range(self.vp) for p in range(self.pp)]
        total = sum(counts)
        if self.architecture.get("num_layers") not in (None, total):
            raise ConversionError(f"{self.iter_dir} holds {total} layers but its args say num_layers="
                                  f"{self.architecture['num_layers']}: mismatched shards")
        if len(set(counts)) > 1:
            raise ConversionError(f"{self.iter_dir}: pipeline chunks hold unequal layer counts {counts}")
        self.architecture["num_layers"] = total

    def _layers_in(self, p: int, v: int) -> int:
        ids = {int(m.group(1)) for m in map(_LAYER_RE.match, self.chunks[(0, p, v)]) if m}
        return max(ids) + 1 if ids else 0

    def merged(self, p: int, v: int, name: str, layout: TensorParallelLayout) -> torch.Tensor:
        shards = [self.chunks[(t, p, v)][name] for t in range(self.tp)]
        if layout.replicated or self.tp == 1:  # no copy: the memory-mapped tensor itself
            return shards[0]
        try:
            return layout.merge(shards, name)
        except (ValueError, RuntimeError) as exc:
            raise ConversionError(f"{self.iter_dir}: cannot merge {name} over {self.tp} tensor ranks "
                                  f"({str(exc).splitlines()[0][:160]}): mismatched shards") from None


def megatron_meta(reader: MegatronCheckpointReader, true_vocab_size: Optional[int], model_type: str) -> ModelMeta:
    sd, args = reader.first, reader.first.get("args")
    tok: Dict[str, Any] = {}
    if args is not None:
        for key in ("vocab_file", "merge_file", "tokenizer_model"):
            if getattr(args, key, None):
                tok[key] = getattr(args, key)
        if getattr(args, "tokenizer_type", None):
            tok["type"] = args.tokenizer_type
    true_vocab = true_vocab_size or sd.get("true_vocab_size") or getattr(args, "true_vocab_size", None)
    src = sd if "consumed_train_samples" in sd else vars(args) if args is not None else {}
    return ModelMeta(
        model_type=model_type, architecture=dict(reader.architecture), true_vocab_size=true_vocab,
        iteration=None if reader.iteration is None else int(sd.get("iteration", reader.iteration)),
        checkpoint_args=args, consumed_train_samples=int(src.get("consumed_train_samples", 0) or 0),
        consumed_valid_samples=int(src.get("consumed_valid_samples", 0) or 0),
        make_vocab_size_divisible_by=int(getattr(args, "make_vocab_size_divisible_by", 128) or 128),
        tokenizer=tok, source=reader.load_dir,
        extra={"tp": reader.tp, "pp": reader.pp, "vp": reader.vp, "opt_param_scheduler":
               sd.get("opt_param_scheduler", sd.get("lr_scheduler"))})


def read_megatron(load_dir: str, *, true_vocab_size: Optional[int] = None, model_type: str = "GPT",
                  trust: bool = False) -> Tuple[ModelMeta, Iterator[Message]]:
    """Loader: (meta, message stream) of a Megatron checkpoint at any TP/PP/virtual-PP layout."""
    reader = MegatronCheckpointReader(load_dir, trust)
    meta = megatron_meta(reader, true_vocab_size, model_type)
    padded = reader.merged(0, 0, WORD, TensorParallelLayout(dim=0)).size(0) if WORD in reader.chunks[(0, 0, 0)] \
        else None
    if padded is None:
        raise ConversionError(f"{reader.files[(0, 0)]} has no {WORD}: not a GPT checkpoint (or a damaged first stage)")
    meta.architecture["padded_vocab_size"] = padded
    first, last = reader.chunks[(0, 0, 0)], reader.chunks[(0, reader.pp - 1, reader.vp - 1)]
    is_bert = any(k.startswith(("lm_head.", "binary_head.")) for k in last)
    if is_bert != (model_type == "BERT"):
        found = "BERT" if is_bert else "GPT"
        raise ConversionError(f"{load_dir} holds a {found} checkpoint: pass --model-type {found}")
    if is_bert:
        meta.extra["bert"] = {"num_tokentypes": first[TOKENTYPE].size(0) if TOKENTYPE in first else 0,
                              "add_binary_head": any(k.startswith("binary_head.") for k in last)}
    if meta.true_vocab_size is not None and meta.true_vocab_size > padded:
        raise ConversionError(f"--true-vocab-size {meta.true_vocab_size} exceeds the checkpoint's {padded} "
                              "vocabulary rows")
    return meta, _stream(reader, meta)


def _stream(reader: MegatronCheckpointReader, meta: ModelMeta) -> Iterator[Message]:
    layouts = layer_layouts(meta)
    rows = slice(0, meta.true_vocab_size)
    first, last = (0, 0), (reader.pp - 1, reader.vp - 1)
    emb = {"word_embeddings.weight": reader.merged(*first, WORD, _layout(layouts, WORD))[rows]}
    for name in (POS, TOKENTYPE):
        if name in reader.chunks[(0, 0, 0)]:
            emb[name[len(LM + "embedding."):]] = reader.chunks[(0, 0, 0)][name]
    yield Message(EMBEDDINGS, emb)
    a = meta.architecture
    nh = a["num_attention_heads"]
    hd = a.get("kv_channels") or a["hidden_size"] // nh
    num_layers = a["num_layers"]
    for i in range(num_layers):
        p, v, local = chunk_of_layer(i, num_layers, reader.pp, reader.vp)
        prefix = f"{LAYERS}{local}."
        tensors = {}
        for name in reader.chunks[(0, p, v)]:
            if not name.startswith(prefix):
                continue
            suffix = name[len(prefix):]
            if suffix.endswith("_extra_state"):
                continue
            if reader.version < 2.0 and "query_key_value" in suffix:
                try:
                    per_rank = [fix_qkv_ordering(reader.chunks[(t, p, v)][name], reader.version, nh // reader.tp, hd)
                                for t in range(reader.tp)]
                except ValueError as exc:
                    raise ConversionError(f"{reader.files[(0, p)]}: {exc}") from None
                tensors[suffix] = _layout(layouts, name).merge(per_rank, name)
            else:
                tensors[suffix] = reader.merged(p, v, name, _layout(layouts, name))
        yield Message(layer_message(i), tensors)
    last_chunk = reader.chunks[(0, *last)]
    norm = {k[len(ENC):]: last_chunk[k] for k in last_chunk if k.startswith(ENC + "final_layernorm.")}
    if not norm:
        raise ConversionError(f"{reader.files[(0, reader.pp - 1)]} has no final_layernorm: incomplete last stage")
    yield Message(FINAL_NORM, norm)
    if not a.get("share_embeddings_and_output_weights", True) and OUT not in last_chunk:
        raise ConversionError(f"{reader.files[(0, reader.pp - 1)]} has no {OUT} but the architecture is untied")
    for prefix, message in HEAD_PARTS:
        tensors = {}
        for name in last_chunk:
            if name.startswith(prefix):
                t = reader.merged(*last, name, _layout(layouts, name))
                tensors[name[len(prefix):] if message != OUTPUT_LAYER else name[len(LM):]] = \
                    t[rows] if name in VOCAB_ROWS else t
        if tensors:
            yield Message(message, tensors)


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
        elif key.startswith(("lm_head.", "binary_head.")):  # BERT's heads: one level, as BertModel saves them
            head, _, tail = key.partition(".")
            out.setdefault(head, {})[tail] = value
        else:
            out[key] = value
    return out


def _saved_args(meta: ModelMeta, tp: int, pp: int, vp_layers: Optional[int], padded: int) -> argparse.Namespace:
    src = meta.checkpoint_args
    if isinstance(src, argparse.Namespace):
        args = copy.copy(src)
    else:
        args = args_namespace(meta)
        for key, value in vars(src or argparse.Namespace()).items():
            setattr(args, key, value)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.num_layers_per_virtual_pipeline_stage = vp_layers
    args.virtual_pipeline_model_parallel_size = (meta.architecture["num_layers"] // pp // vp_layers
                                                 if vp_layers else None)
    args.padded_vocab_size = padded
    args.num_layers = meta.architecture["num_layers"]
    if meta.model_type == "BERT":
        args.bert_binary_head = meta.extra["bert"]["add_binary_head"]
    return args


class MegatronWriter:
    """Consumes the message stream chunk by chunk and writes a Megatron checkpoint under `save_dir`."""

    def __init__(self, meta: ModelMeta, save_dir: str, tp: int, pp: int, vp_layers: Optional[int]) -> None:
        a = meta.architecture
        self.meta, self.save_dir, self.tp, self.pp = meta, save_dir, tp, pp
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

    def _chunk_file(self, t: int, p: int) -> str:
        rank = f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "")
        return os.path.join(self.save_dir, self.iter_name, rank, "model_optim_rng.pt")

    def write(self, messages: Iterator[Message]) -> List[str]:
        """Split each part for the target TP as it arrives and spill its shards to a staging file that is reopened
        memory-mapped, so the resident memory is about one layer; then write each rank file from the staged parts."""
        meta = self.meta
        emb = expect(messages, EMBEDDINGS).tensors
        word = emb["word_embeddings.weight"]
        rows = target_rows(word.size(0), meta.true_vocab_size, meta.make_vocab_size_divisible_by, self.tp)
        self.padded = rows
        meta.architecture["padded_vocab_size"] = rows
        self.layouts = layer_layouts(meta)
        self.parts: Dict[Tuple[int, int, int], Dict[str, Any]] = {
            (t, p, v): {} for t in range(self.tp) for p in range(self.pp) for v in range(self.vp)}
        self.staging = os.path.join(self.save_dir, ".staging")
        last = (self.pp - 1, self.vp - 1)
        emb_flat = {WORD: repad_rows(word, rows)}
        for key in ("position_embeddings.weight", "tokentype_embeddings.weight"):
            if key in emb:
                emb_flat[LM + "embedding." + key] = emb[key]
        tied = meta.architecture.get("share_embeddings_and_output_weights", True)
        if tied and self.pp > 1:  # the last stage's copy of the tied embedding (word_embeddings_for_head)
            self._stage("head", last, {HEAD_COPY: emb_flat[WORD]})
        self._stage("embeddings", (0, 0), emb_flat)
        del word, emb, emb_flat
        for i in range(self.num_layers):
            p, v, local = chunk_of_layer(i, self.num_layers, self.pp, self.vp)
            msg = expect(messages, layer_message(i))
            self._stage(f"layer{i}", (p, v), {f"{LAYERS}{local}.{k}": t for k, t in msg.tensors.items()})
            del msg
        norm = expect(messages, FINAL_NORM).tensors
        self._stage("final_norm", last, {ENC + k: t for k, t in norm.items()})
        prefixes = {message: prefix for prefix, message in HEAD_PARTS}
        seen = set()
        for msg in messages:
            if msg.name not in prefixes or msg.name in seen:
                raise ConversionError(f'unexpected message "{msg.name}" after the final norm (is --model-type right?)')
            seen.add(msg.name)
            prefix = prefixes[msg.name] if msg.name != OUTPUT_LAYER else LM
            flat = {prefix + k: t for k, t in msg.tensors.items()}
            flat = {k: repad_rows(t, rows) if k in VOCAB_ROWS else t for k, t in flat.items()}
            self._stage(msg.name.replace(" ", "_"), last, flat)
        if not tied and OUTPUT_LAYER not in seen:
            raise ConversionError("the loader sent no output layer for an untied model")
        files = self._write_files()
        from megatron import checkpoint_integrity

        checkpoint_integrity.write_manifest(os.path.join(self.save_dir, self.iter_name))  # crc32 per file, as saves do
        atomic_write_text(os.path.join(self.save_dir, TRACKER),
                          "release" if self.iteration is None else str(self.iteration))
        return files

    def _split(self, chunk: Dict[str, Any]) -> List[Dict[str, Any]]:
        shards: List[Dict[str, Any]] = [{} for _ in range(self.tp)]
        for name, value in chunk.items():
            layout = _layout(self.layouts, name)
            try:
                parts = layout.split(value, self.tp, name) if not layout.replicated else [value] * self.tp
            except ValueError as exc:
                raise ConversionError(f"--target-tensor-parallel-size {self.tp}: {exc}") from None
            for t, part in enumerate(parts):
                shards[t][name] = part
        return shards

    def _stage(self, tag: str, where: Tuple[int, int], tensors: Dict[str, Any]) -> None:
        p, v = where
        for t, shard in enumerate(self._split(tensors)):
            path = os.path.join(self.staging, f"{tag}_{t}.pt")
            os.makedirs(self.staging, exist_ok=True)
            torch.save({k: x.contiguous() for k, x in shard.items()}, path)
            self.parts[(t, p, v)].update(torch.load(path, map_location="cpu", mmap=True, weights_only=True))

    def _write_files(self) -> List[str]:
        import shutil

        files = []
        for t in range(self.tp):
            for p in range(self.pp):
                if self.vp == 1:
                    body = {"model": nest(self.parts.pop((t, p, 0)))}
                else:
                    body = {f"model{v}": nest(self.parts.pop((t, p, v))) for v in range(self.vp)}
                path = self._chunk_file(t, p)
                atomic_torch_save(self._file_dict(body), path)
                files.append(path)
                del body  # unmaps the staged tensors of this rank file
        shutil.rmtree(self.staging, ignore_errors=True)
        return files

    def _file_dict(self, body: Dict[str, Any]) -> Dict[str, Any]:
        meta = self.meta
        from megatron.checkpoint_conversion.interchange import architecture_of

        arch = architecture_of(meta.config(padded_vocab_size=self.padded))
        sd: Dict[str, Any] = {
            "args": _saved_args(meta, self.tp, self.pp, self.vp_layers, self.padded),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": 0 if self.iteration is None else self.iteration,
            "consumed_train_samples": meta.consumed_train_samples,
            "consumed_valid_samples": meta.consumed_valid_samples,
            "true_vocab_size": meta.true_vocab_size,
            "padded_vocab_size": self.padded,
            "architecture": arch,
        }
        sched = meta.extra.get("opt_param_scheduler")
        if sched is not None:
            sd["opt_param_scheduler"] = sched
            sd["lr_scheduler"] = sched
        sd.update(body)
        return sd


def write_megatron(meta: ModelMeta, messages: Iterator[Message], save_dir: str, tp: int = 1, pp: int = 1,
                   vp_layers: Optional[int] = None) -> List[str]:
    """Saver: write the stream as a Megatron checkpoint (TP `tp`, PP `pp`, optional virtual chunks)."""
    return MegatronWriter(meta, save_dir, tp, pp, vp_layers).write(messages)
