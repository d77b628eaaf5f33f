"""The shared half of the Hugging Face adapters of decoder-only (causal LM) families: the metadata of a HF folder
being read, and the saver's walk over the message stream (embeddings, layers, final norm, output layer) that hands
each message to the family's own mapping (megatron/models/gpt/hf_gpt2.py, hf_llama.py, hf_moe.py, hf_bloom.py).
Also the pieces every HF saver uses: message tensors that remember which keys were mapped, tokenizer file copying.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.checkpoint.conversion.hf_tokenizer_export import export_tokenizer, write_generation_config
from megatron.checkpoint.conversion.interchange import (
    EMBEDDINGS,
    FINAL_NORM,
    OUTPUT_LAYER,
    ConversionError,
    Message,
    ModelMeta,
    expect,
    layer_message,
)
from megatron.core.transformer_config import TransformerConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")  # transformers 5 keeps the chat template apart

AddTensor = Callable[[str, torch.Tensor], None]


def heads(meta: ModelMeta) -> Tuple[int, int, int]:
    """(query heads, K/V groups, head dim) of the stored architecture."""
    a = meta.architecture
    nq = a["num_attention_heads"]
    return nq, a.get("num_query_groups") or nq, a.get("kv_channels") or a["hidden_size"] // nq


class Checked(dict):
    """A message's tensors that remember which keys the saver used (Megatron's check_message)."""

    def __init__(self, tensors: Dict[str, torch.Tensor], name: str) -> None:
        super().__init__(tensors)
        self.name, self.used = name, set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.used.add(key)
        return super().__getitem__(key)

    def check(self, checking: bool) -> None:
        rest = sorted(set(self) - self.used)
        if rest and checking:
            raise ConversionError(f'message "{self.name}" holds tensors the HF saver does not map ({", ".join(rest)}); '
                                  "if you want to ignore this, use the argument --no-checking")


def copy_tokenizer(meta: ModelMeta, out: str) -> List[str]:
    """Copy the source's tokenizer files into the HF folder `out`; the names copied."""
    tok = meta.tokenizer
    copied = []
    sources: List[Tuple[str, str]] = [(f, os.path.basename(f)) for f in tok.get("files", [])]
    if tok.get("vocab_file"):
        sources.append((tok["vocab_file"], "vocab.json" if tok.get("merge_file") else "vocab.txt"))
    if tok.get("merge_file"):
        sources.append((tok["merge_file"], "merges.txt"))
    model = tok.get("tokenizer_model")
    if model and os.path.isdir(model):
        sources += [(os.path.join(model, n), n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(model, n))]
    elif model:
        sources.append((model, "tokenizer.model"))
    for src, name in sources:
        if os.path.isfile(src) and not os.path.exists(os.path.join(out, name)):
            shutil.copyfile(src, os.path.join(out, name))
            copied.append(name)
    return copied


@dataclass(frozen=True)
class DecoderMapping:
    """A decoder family's mapping, message by message (TP=1 tensors; `add(hf_name, tensor)` writes one)."""

    config_from_hf: Callable[[str, Dict[str, Any]], Dict[str, Any]]  # (folder, config.json) -> architecture fields
    weights_from_hf: Callable[[Any, ModelMeta], Iterator[Message]]  # (lazy tensors, meta) -> message stream
    config_to_hf: Callable[[TransformerConfig, int, Optional[str]], Any]  # (config, vocab rows, --hf-architecture)
    embeddings_to_hf: Callable[[AddTensor, Checked, torch.Tensor], None]  # (add, message, word rows cut)
    layer_to_hf: Callable[[AddTensor, int, Checked, ModelMeta, Any], None]  # (add, i, message, meta, HF config)
    final_norm_to_hf: Callable[[AddTensor, Checked], None]
    # the parts after the output layer (DeepSeek-V3's MTP block): (add, message, meta, {"embedding", "output"} rows cut)
    head_to_hf: Optional[Callable[[AddTensor, Checked, ModelMeta, Dict[str, torch.Tensor]], None]] = None


def read_decoder(mapping: DecoderMapping, load_dir: str, cfg: Dict[str, Any], open_tensors: Callable[[], Any], *,
                 model_type: str, true_vocab_size: Optional[int],
                 tokenizer: Dict[str, Any]) -> Tuple[ModelMeta, Iterator[Message]]:
    """Loader half: the metadata of a decoder HF folder and its message stream."""
    fields = mapping.config_from_hf(load_dir, cfg)
    tensors = open_tensors()
    vocab = int(fields["padded_vocab_size"])
    meta = ModelMeta(model_type=model_type, architecture=fields, true_vocab_size=true_vocab_size or vocab,
                     iteration=None, tokenizer=tokenizer, source=load_dir,
                     extra={"hf_architecture": cfg["architectures"][0], "hf_config": cfg})
    meta.config()  # validates the architecture (one line)
    return meta, mapping.weights_from_hf(tensors, meta)


def write_decoder(mapping: DecoderMapping, meta: ModelMeta, messages: Iterator[Message], save_dir: str, writer: Any,
                  *, hf_architecture: Optional[str], checking: bool) -> Dict[str, Any]:
    """Saver half: the stream into `writer` (safetensors shards), then config.json and the tokenizer files."""
    a = meta.architecture
    emb = Checked(expect(messages, EMBEDDINGS).tensors, EMBEDDINGS)
    rows = meta.true_vocab_size or emb["word_embeddings.weight"].size(0)
    word = emb["word_embeddings.weight"][:rows]
    config = meta.config(padded_vocab_size=rows)  # validate before writing tensors
    try:
        hf_config = mapping.config_to_hf(config, rows, hf_architecture)
    except ValueError as exc:
        raise ConversionError(f"--saver hf: {exc}") from None
    hf_config.dtype = "float32"
    tied = a.get("share_embeddings_and_output_weights", True)
    mapping.embeddings_to_hf(writer.add, emb, word)
    for i in range(a["num_layers"]):
        layer = Checked(expect(messages, layer_message(i)).tensors, layer_message(i))
        mapping.layer_to_hf(writer.add, i, layer, meta, hf_config)
        layer.check(checking)
    emb.check(checking)
    norm = Checked(expect(messages, FINAL_NORM).tensors, FINAL_NORM)
    mapping.final_norm_to_hf(writer.add, norm)
    norm.check(checking)
    head = word if tied else expect(messages, OUTPUT_LAYER).tensors["output_layer.weight"][:rows]
    if not tied:
        writer.add("lm_head.weight", head)
    rest = next(messages, None)
    while rest is not None and mapping.head_to_hf is not None:
        part = Checked(rest.tensors, rest.name)
        mapping.head_to_hf(writer.add, part, meta, {"embedding": word, "output": head})
        part.check(checking)
        rest = next(messages, None)
    if rest is not None:
        raise ConversionError(f'unexpected message "{rest.name}" after the model (is --model-type right?)')
    files = writer.close()
    copied = copy_tokenizer(meta, save_dir)
    exported = export_tokenizer(meta.tokenizer, save_dir)
    for key in ("bos_token_id", "eos_token_id"):
        if exported[key] is not None:
            setattr(hf_config, key, exported[key])
    hf_config.save_pretrained(save_dir)
    copied += exported["files"] + write_generation_config(save_dir, exported["bos_token_id"],
                                                          exported["eos_token_id"])
    return {"files": files, "architecture": hf_config.architectures[0], "tokenizer_files": copied,
            "vocab_size": rows}
