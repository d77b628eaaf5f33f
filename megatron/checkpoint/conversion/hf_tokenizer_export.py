"""The tokenizer half of a Hugging Face export (`convert.py --saver hf`): a folder AutoTokenizer loads with the
training tokenizer's ids, and generation_config.json with its BOS/EOS.

A Llama2Tokenizer model becomes a `tokenizer.json` (the pieces and merges that transformers extracts from
`tokenizer.model`) whose normalizer does what sentencepiece does (the dummy "▁" prefix always, spaces to "▁";
transformers' LlamaTokenizer class would re-install a Metaspace that skips the prefix before a leading space) and
whose post-processor adds BOS as the training tokenizer does (`[bos] + ids`, no EOS). `tokenizer_config.json` names the generic fast tokenizer class so that
AutoTokenizer keeps that file as written. The ids are checked against the training tokenizer on probe texts; a
difference is reported in one line, never hidden.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from megatron.checkpoint.conversion.vocab import true_vocab_size_from_file

PROBES = ["Hello world", " leading space", "two  spaces and a\ttab\nnew line", "digits 12345, ünïcödé",
          "def f(x):\n    return x ** 2\n"]


def _training_tokenizer(model_file: str) -> Any:
    from megatron.tokenizer.llama2_tokenizer import Llama2Tokenizer

    return Llama2Tokenizer(model_file)


def _fast_tokenizer_from_sentencepiece(model_file: str) -> Any:
    """transformers' extraction of a sentencepiece model into a `tokenizers.Tokenizer` (pieces, merges, byte
    fallback), with sentencepiece's own normalisation."""
    import shutil

    from tokenizers import normalizers
    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(model_file, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer"}, f)
        backend = LlamaTokenizer.from_pretrained(tmp)._tokenizer
    import sentencepiece.sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    steps = [normalizers.Prepend("▁")] if proto.normalizer_spec.add_dummy_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    return backend


def export_llama2_tokenizer(model_file: str, out: str, max_length: Optional[int], log: Any = print) -> List[str]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for a Llama2Tokenizer model; returns
    the file names written."""
    from tokenizers import processors

    ours = _training_tokenizer(model_file)
    sp = ours.sp_model
    bos_id, eos_id, unk_id = sp.bos_id(), sp.eos_id(), sp.unk_id()
    piece = lambda i: sp.id_to_piece(i) if i >= 0 else None  # noqa: E731
    backend = _fast_tokenizer_from_sentencepiece(model_file)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{piece(bos_id)} $A", pair=f"{piece(bos_id)} $A {piece(bos_id)} $B",
        special_tokens=[(piece(bos_id), bos_id)])
    backend.save(os.path.join(out, "tokenizer.json"))
    special = {k: piece(v) for k, v in (("bos_token", bos_id), ("eos_token", eos_id), ("unk_token", unk_id))
               if v >= 0}
    config: Dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": True,
                              "add_eos_token": False, "clean_up_tokenization_spaces": False}
    if max_length:
        config["model_max_length"] = int(max_length)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)
    differ = [p for p in PROBES if backend.encode(p).ids != ours.tokenize(p)]
    if differ:
        log(f"note: the exported tokenizer.json encodes {len(differ)} of {len(PROBES)} probe texts differently from "
            f"the training tokenizer (e.g. {differ[0]!r}): its SentencePiece normalisation has no tokenizers "
            "equivalent")
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def write_generation_config(out: str, bos_id: Optional[int], eos_id: Optional[int]) -> List[str]:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id).save_pretrained(out)
    return ["generation_config.json"]


def export_tokenizer(meta_tokenizer: Dict[str, Any], out: str, max_length: Optional[int],
                     log: Any = print) -> Dict[str, Any]:
    """Tokenizer files beyond the copied originals, and the BOS/EOS ids for config.json / generation_config.json."""
    tok_type = meta_tokenizer.get("type")
    model = meta_tokenizer.get("tokenizer_model")
    if tok_type == "Llama2Tokenizer" and model and os.path.isfile(model):
        sp = _training_tokenizer(model).sp_model
        ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id()}
        try:
            return {"files": export_llama2_tokenizer(model, out, max_length, log), **ids}
        except (ImportError, ValueError, RuntimeError, OSError) as exc:
            log(f"note: no tokenizer.json written (tokenizer.model is there): {str(exc).splitlines()[0][:200]}")
            return {"files": [], **ids}
    if tok_type == "GPT2BPETokenizer" and meta_tokenizer.get("vocab_file"):
        with open(meta_tokenizer["vocab_file"], encoding="utf-8") as f:
            eod = json.load(f).get("<|endoftext|>")
        return {"files": [], "bos_token_id": eod, "eos_token_id": eod}
    return {"files": [], "bos_token_id": None, "eos_token_id": None}


def _hf_tokenizer_json_size(path: str) -> Optional[int]:
    """1 + the largest id of a `tokenizer.json` (its model's vocabulary and its added tokens)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", -1) for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    ids = [i for i in ids if isinstance(i, int)]
    return max(ids) + 1 if ids else None


def tokenizer_vocab_size(meta_tokenizer: Dict[str, Any]) -> Optional[Tuple[int, str]]:
    """(ids the tokenizer files copied into the export can produce, the file that says so); None when unknown."""
    vocab_file, model = meta_tokenizer.get("vocab_file"), meta_tokenizer.get("tokenizer_model")
    if vocab_file and os.path.isfile(vocab_file):
        return true_vocab_size_from_file(vocab_file), vocab_file
    if model and os.path.isdir(model) and os.path.isfile(os.path.join(model, "tokenizer.json")):
        size = _hf_tokenizer_json_size(os.path.join(model, "tokenizer.json"))
        return (size, os.path.join(model, "tokenizer.json")) if size else None
    if meta_tokenizer.get("type") == "Llama2Tokenizer" and model and os.path.isfile(model):
        return _training_tokenizer(model).vocab_size, model
    return None
