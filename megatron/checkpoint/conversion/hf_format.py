"""Hugging Face folders (``config.json``, ``model.safetensors`` or sharded ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``, tokenizer files) as a conversion loader and saver.

What a folder holds is a family's business: the loader finds the family's adapter by config.json's ``architectures``
name and the saver by --model-type and the stored architecture, both through megatron/models/registry.py (GPT-2, the
Llama family, its MoE members Mixtral / Qwen2-MoE, BLOOM: megatron/models/gpt/hf_{gpt2,llama,moe,bloom}.py;
MegatronBert: megatron/models/bert/hf.py). This module is what they share: lazy tensor reading, sharded safetensors
writing, the tokenizer files. Tensors are read lazily from the safetensors files.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.checkpoint.conversion.hf_decoder import TOKENIZER_FILES
from megatron.checkpoint.conversion.hf_tokenizer_export import tokenizer_vocab_size
from megatron.checkpoint.conversion.interchange import ConversionError, Message, ModelMeta
from megatron.models import registry

SUPPORTED = registry.supported_architectures()


# ----------------------------------------------------------------------------------------------- reading
class _LazyTensors:
    """Tensor access by name over the (sharded) safetensors / torch files of a HF folder, one file open at a time."""

    def __init__(self, folder: str, trust: bool) -> None:
        self.folder, self.trust = folder, trust
        self.weight_map: Dict[str, str] = {}
        self._open: Tuple[Optional[str], Any] = (None, None)
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            path = os.path.join(folder, index)
            if os.path.isfile(path):
                with open(path) as f:
                    self.weight_map = dict(json.load(f)["weight_map"])
                break
        else:
            for single in ("model.safetensors", "pytorch_model.bin"):
                if os.path.isfile(os.path.join(folder, single)):
                    self.weight_map = {k: single for k in self._keys(single)}
                    break
        if not self.weight_map:
            raise ConversionError(f"--load-dir {folder} has a config.json but no weights (model.safetensors[.index"
                                  ".json] or pytorch_model.bin)")
        for name in sorted(set(self.weight_map.values())):
            if not os.path.isfile(os.path.join(folder, name)):
                raise ConversionError(f"missing weight file {os.path.join(folder, name)} named by the index file")

    def _keys(self, name: str) -> List[str]:
        handle = self._handle(name)
        return list(handle.keys())

    def _handle(self, name: str) -> Any:
        if self._open[0] != name:
            path = os.path.join(self.folder, name)
            if name.endswith(".safetensors"):
                from safetensors import safe_open

                try:
                    handle: Any = safe_open(path, framework="pt")
                except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type (or OSError)
                    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    raise ConversionError(f"{path} is not a readable safetensors file ({detail}): it is truncated or "
                                          "damaged; download or copy it again") from None
            else:
                from megatron.checkpoint.safe_load import safe_torch_load

                handle = safe_torch_load(path, map_location="cpu", trust=self.trust, mmap=True)
            self._open = (name, handle)
        return self._open[1]

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise ConversionError(f"{self.folder}: tensor {key!r} is missing from the weights")
        handle = self._handle(self.weight_map[key])
        return handle.get_tensor(key) if hasattr(handle, "get_tensor") else handle[key]


def _read_config(folder: str) -> Dict[str, Any]:
    if not os.path.isdir(folder):
        raise ConversionError(f"--load-dir {folder} does not exist")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"--load-dir {folder} is not a Hugging Face model folder: no config.json")
    with open(path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED:
        raise ConversionError(f"{path}: architecture {arch!r} is not supported by --loader hf "
                              f"(supported: {', '.join(SUPPORTED)})")
    return cfg


def _tokenizer_of(folder: str, family: str) -> Dict[str, Any]:
    files = [os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    names = {os.path.basename(f) for f in files}
    tok: Dict[str, Any] = {"files": files}
    if family == "bert" and "vocab.txt" in names:
        lower = True
        if "tokenizer_config.json" in names:
            with open(os.path.join(folder, "tokenizer_config.json")) as f:
                lower = bool(json.load(f).get("do_lower_case", True))
        tok.update(type="BertWordPieceLowerCase" if lower else "BertWordPieceCase", vocab_file="vocab.txt")
    elif family == "gpt2" and {"vocab.json", "merges.txt"} <= names:
        tok.update(type="GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")
    elif names & {"tokenizer.json", "tokenizer_config.json"}:
        tok.update(type="HuggingFaceTokenizer", tokenizer_model=".")
    elif "tokenizer.model" in names:
        tok.update(type="Llama2Tokenizer", tokenizer_model="tokenizer.model")
    return tok


def read_hf(load_dir: str, *, true_vocab_size: Optional[int] = None, model_type: str = "GPT",
            trust: bool = False) -> Tuple[ModelMeta, Iterator[Message]]:
    """Loader: (meta, message stream) of a HF folder of a registered architecture."""
    cfg = _read_config(load_dir)
    arch = cfg["architectures"][0]
    adapter = registry.adapter_for_architecture(arch)
    if model_type != adapter.model_type:
        raise ConversionError(f"{load_dir} holds a {arch}: pass --model-type {adapter.model_type}")
    return adapter.read(load_dir, cfg, lambda: _LazyTensors(load_dir, trust), model_type=model_type,
                        true_vocab_size=true_vocab_size, tokenizer=_tokenizer_of(load_dir, adapter.name))


# ----------------------------------------------------------------------------------------------- writing
def parse_size(text: str) -> int:
    """'5GB', '200MB', '1000' -> bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    s = str(text).strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    return int(s)


class _ShardWriter:
    """Writes tensors into safetensors shards of at most `max_bytes`, then the index file (HF's names)."""

    def __init__(self, folder: str, max_bytes: int) -> None:
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: List[Tuple[str, List[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        t = t.detach()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != size:  # a view: safetensors wants own storage
            t = t.contiguous().clone()
        self.pending[name] = t
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        tmp = f".shard{len(self.shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in self.pending.items()}, os.path.join(self.folder, tmp),
                  metadata={"format": "pt"})
        os.chmod(os.path.join(self.folder, tmp), _file_mode())  # safetensors writes 0600; the rest follows the umask
        self.shards.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> List[str]:
        self.flush()
        n = len(self.shards)
        files = []
        if n == 1:
            os.replace(os.path.join(self.folder, self.shards[0][0]), os.path.join(self.folder, "model.safetensors"))
            return [os.path.join(self.folder, "model.safetensors")]
        weight_map = {}
        for i, (tmp, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.folder, tmp), os.path.join(self.folder, final))
            files.append(os.path.join(self.folder, final))
            weight_map.update({k: final for k in names})
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        return files


def hf_adapter_for(meta: ModelMeta) -> Any:
    """The registered adapter whose saver writes this model (one line when none does)."""
    adapter = registry.adapter_for_model(meta.model_type, meta.architecture)
    if adapter is not None:
        return adapter
    candidates = registry.adapters_for_model_type(meta.model_type)
    if not candidates:
        types = registry.model_types()
        raise ConversionError(f"--saver hf converts {' and '.join(types)} models, not {meta.model_type}")
    raise ConversionError("--saver hf: this architecture is neither " +
                          " nor ".join(dict.fromkeys(a.description for a in candidates)))


def _file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def check_vocab_covers_tokenizer(meta: ModelMeta) -> None:
    """The exported embedding keeps `meta.true_vocab_size` rows: fewer than the ids of the tokenizer files copied
    beside it would make a folder whose tokenizer produces ids the model has no row for (one-line error)."""
    known = tokenizer_vocab_size(meta.tokenizer) if meta.true_vocab_size is not None else None
    if known is not None and meta.true_vocab_size < known[0]:
        raise ConversionError(f"--true-vocab-size {meta.true_vocab_size} is smaller than the tokenizer's vocabulary "
                              f"({known[0]} ids in {known[1]}): the exported model would have no embedding row for "
                              f"ids >= {meta.true_vocab_size}; pass --true-vocab-size {known[0]} (or drop it)")


def write_hf(meta: ModelMeta, messages: Iterator[Message], save_dir: str, *, max_shard_size: str = "2GB",
             hf_architecture: Optional[str] = None, checking: bool = True) -> Dict[str, Any]:
    """Saver: the stream as a HF folder (safetensors shards + index, config.json, tokenizer files)."""
    adapter = hf_adapter_for(meta)
    check_vocab_covers_tokenizer(meta)
    os.makedirs(save_dir, exist_ok=True)
    writer = _ShardWriter(save_dir, parse_size(max_shard_size))
    return adapter.write(meta, messages, save_dir, writer, hf_architecture=hf_architecture, checking=checking)
