"""What a Hugging Face adapter is: the HF architecture names a family reads, and its loader and saver halves
(config and weights from HF, config and weights to HF). Adapters are listed in megatron/models/registry.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Tuple


@dataclass(frozen=True)
class HFAdapter:
    """One family's Hugging Face adapter.

    read(load_dir, config_json, open_tensors, *, model_type, true_vocab_size, tokenizer) -> (ModelMeta, messages):
        ``open_tensors()`` gives ``get(name)``, ``keys()`` and ``in`` over the folder's weights (read lazily).
    write(meta, messages, save_dir, writer, *, hf_architecture, checking) -> summary dict:
        ``writer.add(name, tensor)`` / ``writer.close()`` write the safetensors shards.
    accepts(architecture fields) -> whether the saver writes this Megatron architecture as this family.
    """

    name: str  # also the tokenizer hint: "gpt2" reads vocab.json/merges.txt, "bert" vocab.txt
    model_type: str  # Megatron's --model-type
    architectures: Tuple[str, ...]  # config.json "architectures" names read by this adapter
    read: Callable[..., Tuple[Any, Iterator[Any]]]
    write: Callable[..., Dict[str, Any]]
    accepts: Callable[[Dict[str, Any]], bool] = lambda architecture: True
    description: str = ""  # for the saver's refusal line ("neither A nor B ...")
