"""T5 checkpoints (megatron/model/t5_model.py's layout, Megatron's T5Model keys) as a Megatron loader and saver:
tensor-parallel reshape with the vocabulary re-padded for the target TP, one part at a time.

Message stream of a T5 model (full TP=1 tensors; keys relative to the part, as GPT's stream)::

    "embeddings"                 word_embeddings.weight [vocab rows], position_embeddings.weight
    "encoder layer {i}"          suffixes after ``language_model.encoder.layers.{i}.``
    "encoder final norm"         final_layernorm.* (of ``language_model.encoder.``)
    "decoder layer {i}"          suffixes after ``language_model.decoder.layers.{i}.`` (self_attention,
                                 inter_attention.{query,key_value,dense}, post_inter_attention_layernorm, mlp)
    "decoder final norm"         final_layernorm.* (of ``language_model.decoder.``)
    "lm head"                    bias [vocab rows] (the logits use the tied word embeddings)

Pipeline-parallel T5 checkpoints (--pipeline-model-parallel-split-rank) are not reshaped here yet: a PP > 1 source
or target is refused with one line. The training state is not converted (weights only).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.checkpoint_conversion.interchange import ConversionError, Message, ModelMeta, expect
from megatron.checkpoint_conversion.megatron_format import (
    LM,
    POS,
    TRACKER,
    WORD,
    MegatronCheckpointReader,
    MegatronWriter,
    megatron_meta,
)
from megatron.checkpoint_conversion.vocab import repad_rows, target_rows
from megatron.core.tensor_parallel.layout import REPLICATED, TensorParallelLayout

EMBEDDINGS = "embeddings"
LM_HEAD_BIAS = "lm_head.bias"
PP_REFUSED = ("T5 checkpoints are reshaped between tensor-parallel sizes only: pipeline-parallel T5 "
              "(--pipeline-model-parallel-split-rank) is not converted yet; use {what} 1")


def _stack(part: str) -> str:
    return f"{LM}{part}."


def t5_layer_counts(meta: ModelMeta) -> Tuple[int, int]:
    t5 = meta.extra["t5"]
    return t5["encoder_num_layers"], t5["decoder_num_layers"]


def t5_layouts(meta: ModelMeta) -> Dict[str, TensorParallelLayout]:
    """{flat parameter name of the TP=1 T5Model: its TP layout}, declared by the model built on the meta device."""
    from megatron.core.tensor_parallel.layout import get_tp_layout
    from megatron.model.t5_model import T5Model

    enc, dec = t5_layer_counts(meta)
    config = dataclasses.replace(meta.config(padded_vocab_size=meta.architecture["padded_vocab_size"]),
                                 encoder_num_layers=enc, decoder_num_layers=dec)
    with torch.device("meta"):
        model = T5Model(config)
    return {name: get_tp_layout(p) for name, p in model.named_parameters()}


class T5CheckpointReader(MegatronCheckpointReader):
    """A Megatron T5 checkpoint's files (TP any, PP 1): GPT's reader counts encoder layers only, so the layer-count
    check against --num-layers is replaced by T5's own (encoder and decoder counts)."""

    def _open(self) -> None:
        num_layers = self.architecture.pop("num_layers", None)
        super()._open()
        self.architecture["num_layers"] = num_layers


def read_t5(load_dir: str, *, true_vocab_size: Optional[int] = None,
            trust: bool = False) -> Tuple[ModelMeta, Iterator[Message]]:
    """Loader: (meta, message stream) of a Megatron T5 checkpoint."""
    reader = T5CheckpointReader(load_dir, trust)
    if reader.pp > 1:
        raise ConversionError(f"{load_dir}: " + PP_REFUSED.format(what="a --pipeline-model-parallel-size"))
    meta = megatron_meta(reader, true_vocab_size, "T5")
    first = reader.chunks[(0, 0, 0)]
    if not any(k.startswith(_stack("decoder")) for k in first) or LM_HEAD_BIAS not in first:
        raise ConversionError(f"{load_dir} holds no T5 decoder / lm_head.bias: not a T5 checkpoint (pass the "
                              "--model-type it was trained as)")
    layer_ids = {part: {int(k[len(_stack(part)) + len("layers."):].split(".")[0]) for k in first
                        if k.startswith(_stack(part) + "layers.")} for part in ("encoder", "decoder")}
    enc, dec = (max(layer_ids[p]) + 1 if layer_ids[p] else 0 for p in ("encoder", "decoder"))
    args = meta.checkpoint_args
    for field, have in (("encoder_num_layers", enc), ("decoder_num_layers", dec)):
        said = meta.architecture.get(field) or getattr(args, field, None)
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
    return meta, _stream(reader, meta)


def _stream(reader: T5CheckpointReader, meta: ModelMeta) -> Iterator[Message]:
    layouts = t5_layouts(meta)
    chunk = reader.chunks[(0, 0, 0)]
    rows = slice(0, meta.true_vocab_size)

    def merged(name: str) -> torch.Tensor:
        return reader.merged(0, 0, name, layouts.get(name, REPLICATED))

    yield Message(EMBEDDINGS, {"word_embeddings.weight": merged(WORD)[rows], "position_embeddings.weight":
                               merged(POS)})
    counts = dict(zip(("encoder", "decoder"), t5_layer_counts(meta)))
    for part in ("encoder", "decoder"):
        for i in range(counts[part]):
            prefix = f"{_stack(part)}layers.{i}."
            yield Message(f"{part} layer {i}", {k[len(prefix):]: merged(k) for k in chunk
                                                if k.startswith(prefix) and not k.endswith("_extra_state")})
        prefix = _stack(part)
        norm = {k[len(prefix):]: merged(k) for k in chunk if k.startswith(prefix + "final_layernorm.")}
        if not norm:
            raise ConversionError(f"{reader.files[(0, 0)]} has no {part} final_layernorm: incomplete checkpoint")
        yield Message(f"{part} final norm", norm)
    yield Message("lm head", {"bias": merged(LM_HEAD_BIAS)[rows]})


class T5Writer(MegatronWriter):
    """Writes the T5 stream at TP `tp` (PP 1), reusing the GPT writer's staging, splitting and file writing."""

    def __init__(self, meta: ModelMeta, save_dir: str, tp: int, pp: int, vp_layers: Optional[int]) -> None:
        if pp != 1 or vp_layers:
            raise ConversionError(PP_REFUSED.format(what="--target-pipeline-parallel-size"))
        super().__init__(meta, save_dir, tp, 1, None)

    def write(self, messages: Iterator[Message]) -> List[str]:
        meta = self.meta
        emb = expect(messages, EMBEDDINGS).tensors
        word = emb["word_embeddings.weight"]
        rows = target_rows(word.size(0), meta.true_vocab_size, meta.make_vocab_size_divisible_by, self.tp)
        self.padded = rows
        meta.architecture["padded_vocab_size"] = rows
        self.layouts = t5_layouts(meta)
        self.parts = {(t, 0, 0): {} for t in range(self.tp)}
        self.opt_parts = {k: {} for k in self.parts}
        self.with_optimizer = False
        self.staging = os.path.join(self.save_dir, ".staging")
        self._stage("embeddings", (0, 0), {WORD: repad_rows(word, rows), POS: emb["position_embeddings.weight"]})
        del word, emb
        for part, count in zip(("encoder", "decoder"), t5_layer_counts(meta)):
            for i in range(count):
                msg = expect(messages, f"{part} layer {i}")
                self._stage(f"{part}{i}", (0, 0), {f"{_stack(part)}layers.{i}.{k}": t for k, t in msg.tensors.items()})
            msg = expect(messages, f"{part} final norm")
            self._stage(f"{part}_norm", (0, 0), {_stack(part) + k: t for k, t in msg.tensors.items()})
        head = expect(messages, "lm head")
        self._stage("lm_head", (0, 0), {LM_HEAD_BIAS: repad_rows(head.tensors["bias"], rows)})
        extra = next(messages, None)
        if extra is not None:
            raise ConversionError(f'unexpected message "{extra.name}" after the T5 lm head (is --model-type right?)')
        files = self._write_files()
        from megatron import checkpoint_integrity
        from megatron.atomic_io import atomic_write_text

        checkpoint_integrity.write_manifest(os.path.join(self.save_dir, self.iter_name))
        atomic_write_text(os.path.join(self.save_dir, TRACKER),
                          "release" if self.iteration is None else str(self.iteration))
        return files

    def _file_dict(self, body: Dict[str, Any]) -> Dict[str, Any]:
        sd = super()._file_dict(body)
        enc, dec = t5_layer_counts(self.meta)
        sd["architecture"].update(encoder_num_layers=enc, decoder_num_layers=dec)
        sd["args"].encoder_num_layers, sd["args"].decoder_num_layers = enc, dec
        return sd


def write_t5(meta: ModelMeta, messages: Iterator[Message], save_dir: str, tp: int = 1, pp: int = 1,
             vp_layers: Optional[int] = None) -> List[str]:
    """Saver: write the T5 stream as a Megatron checkpoint at TP `tp`."""
    return T5Writer(meta, save_dir, tp, pp, vp_layers).write(messages)
