"""T5 checkpoints (megatron/models/t5/model.py's layout, Megatron's T5Model keys) as a Megatron loader and saver:
tensor-parallel reshape with the vocabulary re-padded for the target TP, one part at a time.

Message stream of a T5 model (full TP=1 tensors; keys relative to the part, as GPT's stream)::

    "embeddings"                 word_embeddings.weight [vocab rows], position_embeddings.weight
    "encoder layer {i}"          suffixes after ``language_model.encoder.layers.{i}.``
    "encoder final norm"         final_layernorm.* (of ``language_model.encoder.``)
    "decoder layer {i}"          suffixes after ``language_model.decoder.layers.{i}.`` (self_attention,
                                 inter_attention.{query,key_value,dense}, post_inter_attention_layernorm, mlp)
    "decoder final norm"         final_layernorm.* (of ``language_model.decoder.``)
    "lm head"                    bias [vocab rows] (the logits use the tied word embeddings)

Pipeline-parallel T5 (Megatron 23.06's --pipeline-model-parallel-split-rank R, t5_model.t5_stage_roles): stages
0..R-1 hold the encoder layers (numbered from 0 per stage), stage R-1 the encoder's final LayerNorm, stages R..P-1
the decoder layers, stage R a copy of the embeddings, the last stage the decoder's final LayerNorm, ``lm_head`` and
(when it is not stage R) ``word_embeddings_for_head``. The target's split rank is
``--target-pipeline-model-parallel-split-rank`` (default: the source's when the pipeline size is unchanged).
Virtual pipeline stages do not exist for T5. With the training state (the loader's ``optimizer=True``) each message
also carries its parameters' optimizer state (fp32 main param, Adam moments; regular or distributed optimizer), merged
and split with the parameters' own TP layouts as for GPT (optimizer_state.py): the copies of the tied embeddings on
stage R and the last stage get stage 0's state (their gradients are summed with it), and the padded vocabulary rows
stay as trained.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.checkpoint.atomic_io import atomic_write_text
from megatron.checkpoint.conversion.interchange import ConversionError, Message, ModelMeta, expect
from megatron.checkpoint.conversion.megatron_format import (
    LM,
    POS,
    TRACKER,
    WORD,
    MegatronCheckpointReader,
    MegatronWriter,
    attach_optimizer_state,
    megatron_meta,
    sign_output,
)
from megatron.checkpoint.conversion.vocab import repad_rows, target_rows
from megatron.core.tensor_parallel.layout import REPLICATED, TensorParallelLayout, get_tp_layout
from megatron.models import registry
from megatron.run_configs.saved_args import SavedRunArgs

EMBEDDINGS = "embeddings"
LM_HEAD_BIAS = "lm_head.bias"
HEAD_COPY = "word_embeddings.weight"  # the last stage's copy of the tied word embeddings


def stage_of(i: int, count: int, first: int, stages: int, what: str) -> Tuple[int, int]:
    """(pipeline stage, local index) of layer `i` of a stack of `count` layers over `stages` stages from `first`."""
    if count % stages:
        raise ConversionError(f"{what}: {count} layers do not split evenly over {stages} pipeline stage(s)")
    per = count // stages
    return first + i // per, i % per


def _stack(part: str) -> str:
    return f"{LM}{part}."


def t5_layer_counts(meta: ModelMeta) -> Tuple[int, int]:
    t5 = meta.extra["t5"]
    return t5["encoder_num_layers"], t5["decoder_num_layers"]


def t5_layouts(meta: ModelMeta) -> Dict[str, TensorParallelLayout]:
    """{flat parameter name of the TP=1 encoder-decoder model: its TP layout}, declared by the model its family's
    checkpoint layout builds on the meta device (with the stacks' layer counts of `meta`)."""
    family = registry.layout_for(meta.model_type)
    enc, dec = t5_layer_counts(meta)
    model = family.layout_model(meta.config(padded_vocab_size=meta.architecture["padded_vocab_size"]),
                                {"encoder_num_layers": enc, "decoder_num_layers": dec})
    return {name: get_tp_layout(p) for name, p in model.named_parameters()}


class T5CheckpointReader(MegatronCheckpointReader):
    """A Megatron T5 checkpoint's files (any TP and PP): GPT's reader counts encoder layers per stage, so its
    layer-count checks are replaced by T5's own (encoder and decoder counts, read_t5)."""

    def _open(self) -> None:
        num_layers = self.architecture.pop("num_layers", None)
        super()._open()
        self.architecture["num_layers"] = num_layers

    def _layers_in(self, p: int, v: int) -> int:
        return 0

    def parameter_order(self, meta: ModelMeta) -> List[str]:
        return list(t5_layouts(meta))

    def layers(self, part: str, p: int) -> int:
        prefix = _stack(part) + "layers."
        ids = {int(k[len(prefix):].split(".")[0]) for k in self.chunks[(0, p, 0)] if k.startswith(prefix)}
        return max(ids) + 1 if ids else 0


def read_t5(load_dir: str, *, true_vocab_size: Optional[int] = None, trust: bool = False,
            optimizer: bool = False, iteration: Optional[int] = None, verify: bool = True
            ) -> Tuple[ModelMeta, Iterator[Message]]:
    """Loader: (meta, message stream) of a Megatron T5 checkpoint (the tracker's iteration, or `iteration`); with
    `optimizer`, the messages also carry the training state when the checkpoint has one (optimizer_state.py).
    `verify=False`: the caller vouches for the files (a save reading what it just wrote), no manifest check."""
    reader = T5CheckpointReader(load_dir, trust, iteration, verify)
    meta = megatron_meta(reader, true_vocab_size, "T5")
    saved = SavedRunArgs.from_args(meta.checkpoint_args)
    last = reader.chunks[(0, reader.pp - 1, 0)]
    if not any(k.startswith(_stack("decoder")) for k in last) or LM_HEAD_BIAS not in last:
        raise ConversionError(f"{load_dir} holds no T5 decoder / lm_head.bias: not a T5 checkpoint (pass the "
                              "--model-type it was trained as)")
    split = saved.pipeline_model_parallel_split_rank if reader.pp > 1 else 1
    if split is None or not 0 < split < reader.pp + (reader.pp == 1):
        raise ConversionError(f"{reader.files[(0, 0)]}: a T5 checkpoint with {reader.pp} pipeline stages needs "
                              f"args.pipeline_model_parallel_split_rank in 1..{reader.pp - 1} (got {split})")
    enc_stages, dec_stages = (range(split), range(split, reader.pp)) if reader.pp > 1 else ([0], [0])
    per = {part: {reader.layers(part, p) for p in stages}
           for part, stages in (("encoder", enc_stages), ("decoder", dec_stages))}
    if any(len(v) != 1 for v in per.values()):
        raise ConversionError(f"{reader.iter_dir}: pipeline stages hold unequal layer counts {per}: mismatched "
                              "shards")
    enc, dec = per["encoder"].pop() * len(enc_stages), per["decoder"].pop() * len(dec_stages)
    meta.extra["split_rank"] = split if reader.pp > 1 else None
    for field, have in (("encoder_num_layers", enc), ("decoder_num_layers", dec)):
        said = meta.architecture.get(field) or getattr(saved, field)
        if said not in (None, have):
            raise ConversionError(f"{reader.files[(0, 0)]} holds {have} {field.split('_')[0]} layers but its args "
                                  f"say {field}={said}: mismatched shards")
    meta.extra["t5"] = {"encoder_num_layers": enc, "decoder_num_layers": dec}
    meta.architecture["num_layers"] = meta.architecture.get("num_layers") or enc
    padded = reader.merged(0, 0, WORD, TensorParallelLayout(dim=0)).size(0)
    meta.architecture["padded_vocab_size"] = padded
    if meta.true_vocab_size is not None and meta.true_vocab_size > padded:
        raise ConversionError(f"--true-vocab-size {meta.true_vocab_size} exceeds the checkpoint's {padded} "
                              "vocabulary rows")
    if optimizer and meta.iteration is not None:
        attach_optimizer_state(reader, meta, padded)
    return meta, _stream(reader, meta)


def _stages(pp: int, split: Optional[int]) -> Dict[str, Tuple[int, int]]:
    """{stack: (first stage, number of stages)} of a layout."""
    if pp == 1:
        return {"encoder": (0, 1), "decoder": (0, 1)}
    return {"encoder": (0, split), "decoder": (split, pp - split)}


def _stream(reader: T5CheckpointReader, meta: ModelMeta) -> Iterator[Message]:
    layouts = t5_layouts(meta)
    # with the training state the padded rows stay as trained (see optimizer_state.py)
    rows = slice(0, meta.true_vocab_size if reader.opt is None else None)
    stages = _stages(reader.pp, meta.extra["split_rank"])

    def merged(p: int, name: str) -> torch.Tensor:
        return reader.merged(p, 0, name, layouts.get(name, REPLICATED))

    def opt(p: int, names: Dict[str, str], cut: Tuple[str, ...] = ()) -> Dict[str, Dict[str, torch.Tensor]]:
        """{message key: merged optimizer entry} of stage `p`'s parameters `names` ({message key: flat name})."""
        if reader.opt is None:
            return {}
        out = {}
        for key, name in names.items():
            if name in reader.opt[(0, p, 0)]:
                entry = reader.opt_merged(p, 0, name, layouts.get(name, REPLICATED))
                out[key] = {k: t[rows] for k, t in entry.items()} if key in cut else entry
        return out

    emb_names = {"word_embeddings.weight": WORD, "position_embeddings.weight": POS}
    yield Message(EMBEDDINGS, {"word_embeddings.weight": merged(0, WORD)[rows], "position_embeddings.weight":
                               merged(0, POS)}, opt(0, emb_names, cut=("word_embeddings.weight",)))
    counts = dict(zip(("encoder", "decoder"), t5_layer_counts(meta)))
    for part in ("encoder", "decoder"):
        first, n = stages[part]
        for i in range(counts[part]):
            p, local = stage_of(i, counts[part], first, n, part)
            prefix = f"{_stack(part)}layers.{local}."
            names = {k[len(prefix):]: k for k in reader.chunks[(0, p, 0)]
                     if k.startswith(prefix) and not k.endswith("_extra_state")}
            yield Message(f"{part} layer {i}", {key: merged(p, k) for key, k in names.items()}, opt(p, names))
        prefix, end = _stack(part), first + n - 1
        names = {k[len(prefix):]: k for k in reader.chunks[(0, end, 0)] if k.startswith(prefix + "final_layernorm.")}
        if not names:
            raise ConversionError(f"{reader.files[(0, end)]} has no {part} final_layernorm: incomplete checkpoint")
        yield Message(f"{part} final norm", {key: merged(end, k) for key, k in names.items()}, opt(end, names))
    yield Message("lm head", {"bias": merged(reader.pp - 1, LM_HEAD_BIAS)[rows]},
                  opt(reader.pp - 1, {"bias": LM_HEAD_BIAS}, cut=("bias",)))


def t5_messages_from_state_dict(flat: Dict[str, torch.Tensor], encoder_layers: int,
                                decoder_layers: int) -> Iterator[Message]:
    """The T5 message stream of a full TP=1 flat state dict (megatron/models/t5/model.py's names); the inverse of
    `t5_state_dict_from_messages`."""
    def part(prefix: str) -> Dict[str, torch.Tensor]:
        return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}

    yield Message(EMBEDDINGS, part(f"{LM}embedding."))
    for stack, count in (("encoder", encoder_layers), ("decoder", decoder_layers)):
        for i in range(count):
            yield Message(f"{stack} layer {i}", part(f"{_stack(stack)}layers.{i}."))
        yield Message(f"{stack} final norm", {k: v for k, v in part(_stack(stack)).items()
                                              if k.startswith("final_layernorm.")})
    yield Message("lm head", part("lm_head."))


def t5_state_dict_from_messages(messages: Iterator[Message]) -> Dict[str, torch.Tensor]:
    """A T5 message stream -> the full TP=1 flat state dict of megatron/models/t5/model.py."""
    out: Dict[str, torch.Tensor] = {}
    for msg in messages:
        part, _, what = msg.name.partition(" ")
        if msg.name == EMBEDDINGS:
            prefix = f"{LM}embedding."
        elif part in ("encoder", "decoder") and what.startswith("layer "):
            prefix = f"{_stack(part)}layers.{int(what[len('layer '):])}."
        elif part in ("encoder", "decoder") and what == "final norm":
            prefix = _stack(part)
        elif msg.name == "lm head":
            prefix = "lm_head."
        else:
            raise ConversionError(f"unknown T5 message {msg.name!r}")
        out.update({prefix + k: v for k, v in msg.tensors.items()})
    return out


class T5Writer(MegatronWriter):
    """Writes the T5 stream at TP `tp` (PP 1), reusing the GPT writer's staging, splitting and file writing."""

    def __init__(self, meta: ModelMeta, save_dir: str, tp: int, pp: int, vp_layers: Optional[int],
                 split_rank: Optional[int] = None) -> None:
        if vp_layers:
            raise ConversionError("--target-num-layers-per-virtual-pipeline-stage: interleaved pipeline stages are "
                                  "not supported for T5")
        super().__init__(meta, save_dir, tp, 1, None)
        if pp > 1:
            if split_rank is None and meta.extra.get("pp") == pp:
                split_rank = meta.extra.get("split_rank")
            if split_rank is None or not 0 < split_rank < pp:
                raise ConversionError(f"--target-pipeline-parallel-size {pp} for T5 needs "
                                      f"--target-pipeline-model-parallel-split-rank in 1..{pp - 1} (stages before it "
                                      "run the encoder, the rest the decoder)")
        self.pp, self.split_rank = pp, split_rank if pp > 1 else None
        meta.extra["written_split_rank"] = self.split_rank  # for the model flags convert.py prints
        self.stages = _stages(pp, self.split_rank)
        for part, count in zip(("encoder", "decoder"), t5_layer_counts(meta)):
            stage_of(0, count, *self.stages[part], f"--target-pipeline-parallel-size {pp} ({part})")

    def write(self, messages: Iterator[Message]) -> List[str]:
        meta = self.meta
        emb_msg = expect(messages, EMBEDDINGS)
        emb, emb_opt = emb_msg.tensors, emb_msg.optimizer
        word = emb["word_embeddings.weight"]
        rows = target_rows(word.size(0), meta.true_vocab_size, meta.make_vocab_size_divisible_by, self.tp)
        self.padded = rows
        meta.architecture["padded_vocab_size"] = rows
        self.layouts = t5_layouts(meta)
        self.parts = {(t, p, 0): {} for t in range(self.tp) for p in range(self.pp)}
        self.opt_parts = {k: {} for k in self.parts}
        self.with_optimizer = bool(meta.extra.get("optimizer"))
        self.staging = os.path.join(self.save_dir, ".staging")
        embeddings = {WORD: repad_rows(word, rows), POS: emb["position_embeddings.weight"]}
        emb_state = {WORD: {k: repad_rows(x, rows) for k, x in emb_opt.get("word_embeddings.weight", {}).items()},
                     POS: emb_opt.get("position_embeddings.weight", {})}
        last, split = self.pp - 1, self.split_rank
        # stage 0's embeddings and, under a split, the decoder's copy on stage R; the copies' gradients are summed
        # with stage 0's, so their optimizer state is stage 0's
        for p in sorted({0, split or 0}):
            self._stage(f"embeddings{p}", (p, 0), embeddings, emb_state)
        if self.pp > 1 and last != split:  # the last stage's copy of the tied word embeddings for its head
            self._stage("head_copy", (last, 0), {HEAD_COPY: embeddings[WORD]}, {HEAD_COPY: emb_state[WORD]})
        del word, emb, embeddings, emb_opt, emb_state, emb_msg
        for part, count in zip(("encoder", "decoder"), t5_layer_counts(meta)):
            first, n = self.stages[part]
            for i in range(count):
                p, local = stage_of(i, count, first, n, part)
                msg = expect(messages, f"{part} layer {i}")
                prefix = f"{_stack(part)}layers.{local}."
                self._stage(f"{part}{i}", (p, 0), {prefix + k: t for k, t in msg.tensors.items()},
                            {prefix + k: e for k, e in msg.optimizer.items()})
            msg = expect(messages, f"{part} final norm")
            self._stage(f"{part}_norm", (first + n - 1, 0), {_stack(part) + k: t for k, t in msg.tensors.items()},
                        {_stack(part) + k: e for k, e in msg.optimizer.items()})
        head = expect(messages, "lm head")
        self._stage("lm_head", (last, 0), {LM_HEAD_BIAS: repad_rows(head.tensors["bias"], rows)},
                    {LM_HEAD_BIAS: {k: repad_rows(x, rows) for k, x in head.optimizer.get("bias", {}).items()}})
        extra = next(messages, None)
        if extra is not None:
            raise ConversionError(f'unexpected message "{extra.name}" after the T5 lm head (is --model-type right?)')
        files = self._write_files()
        sign_output(os.path.join(self.save_dir, self.iter_name), self.meta)
        atomic_write_text(os.path.join(self.save_dir, TRACKER),
                          "release" if self.iteration is None else str(self.iteration))
        return files

    def _file_dict(self, body: Dict[str, Any]) -> Dict[str, Any]:
        sd = super()._file_dict(body)
        enc, dec = t5_layer_counts(self.meta)
        sd["architecture"].update(encoder_num_layers=enc, decoder_num_layers=dec)
        sd["args"].encoder_num_layers, sd["args"].decoder_num_layers = enc, dec
        sd["args"].pipeline_model_parallel_split_rank = self.split_rank
        return sd


def write_t5(meta: ModelMeta, messages: Iterator[Message], save_dir: str, tp: int = 1, pp: int = 1,
             vp_layers: Optional[int] = None, split_rank: Optional[int] = None) -> List[str]:
    """Saver: write the T5 stream as a Megatron checkpoint at TP `tp`, PP `pp` split at `split_rank`."""
    split_rank = split_rank if split_rank is not None else meta.extra.get("target_split_rank")
    return T5Writer(meta, save_dir, tp, pp, vp_layers, split_rank).write(messages)
