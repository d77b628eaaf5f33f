"""The tokenizer half of a Hugging Face export (`convert.py --saver hf`): a folder AutoTokenizer loads with the
training tokenizer's ids, and generation_config.json with its BOS/EOS, for every --tokenizer-type that has files.

GPT2BPETokenizer and BertWordPiece* get a tokenizer_config.json naming their HF class next to the copied vocab
(and merges); HuggingFaceTokenizer / PretrainedFromHF (`--tokenizer-name-or-path`, BLOOM's) are saved with
save_pretrained from the training folder or the local HF cache (with its chat template; SFTTokenizer's named prompt
format becomes the chat_template). A Llama2Tokenizer model becomes a `tokenizer.json`
(the pieces and merges that transformers extracts from `tokenizer.model`) whose normalizer does what sentencepiece
does (the dummy "▁" prefix always, spaces to "▁"; transformers' LlamaTokenizer class would re-install a Metaspace
that skips the prefix before a leading space) and whose post-processor adds BOS as the training tokenizer does
(`[bos] + ids`, no EOS). A SentencePieceTokenizer model becomes a `tokenizer.json` too (a unigram model, T5's, is
rebuilt from its pieces, scores and normalisation) with no BOS/EOS added and Megatron's appended special tokens
(<CLS>, <SEP>, <EOD>, <MASK>, ...) at Megatron's ids. `tokenizer_config.json` names the generic fast tokenizer
class so that AutoTokenizer keeps that file as written. The ids are checked against the training tokenizer on probe
texts; a difference is reported in one line, never hidden. A tokenizer whose files are gone is one ConversionError;
a checkpoint without a tokenizer (or NullTokenizer) gets a one-line note.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from megatron.checkpoint.conversion.interchange import ConversionError
from megatron.checkpoint.conversion.vocab import true_vocab_size_from_file
from megatron.settings import flag_spelling
from megatron.tokenizer.chat_format import PROMPT_FORMATS
from megatron.tokenizer.hf_tokenizer import HuggingFaceTokenizer, PretrainedFromHFTokenizer, TokenizerLoadError
from megatron.tokenizer.llama2_tokenizer import Llama2Tokenizer
from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

PROBES = ["Hello world", " leading space", "two  spaces and a\ttab\nnew line", "digits 12345, ünïcödé",
          "def f(x):\n    return x ** 2\n"]


def _training_tokenizer(model_file: str) -> Any:
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


def export_llama2_tokenizer(model_file: str, out: str, log: Any = print) -> List[str]:
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
    _write_tokenizer_config(out, {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": True,
                                  "add_eos_token": False, "clean_up_tokenization_spaces": False})
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)
    differ = [p for p in PROBES if backend.encode(p).ids != ours.tokenize(p)]
    if differ:
        log(f"note: the exported tokenizer.json encodes {len(differ)} of {len(PROBES)} probe texts differently from "
            f"the training tokenizer (e.g. {differ[0]!r}): its SentencePiece normalisation has no tokenizers "
            "equivalent")
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def _unigram_from_sentencepiece(model_file: str) -> Optional[Any]:
    """A unigram sentencepiece model (T5's) as a `tokenizers.Tokenizer` (None for another model type): its pieces and
    scores, its precompiled normalisation, sentencepiece's whitespace handling (strip and collapse, the dummy "▁"
    prefix, spaces to "▁") and pieces that never cross a "▁" boundary. Equal-score segmentations may break ties
    differently (the probe note)."""
    import sentencepiece.sentencepiece_model_pb2 as pb
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    proto = pb.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    if trainer.model_type != pb.TrainerSpec.UNIGRAM:
        return None
    backend = Tokenizer(models.Unigram([(p.piece, p.score) for p in proto.pieces], trainer.unk_id,
                                       byte_fallback=trainer.byte_fallback))
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    steps += ([normalizers.Prepend("▁")] if spec.add_dummy_prefix else []) + [normalizers.Replace(" ", "▁")]
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never",
                                                     split=trainer.split_by_whitespace)
    return backend


def export_sentencepiece_tokenizer(model_file: str, out: str, log: Any = print) -> List[str]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for a SentencePieceTokenizer run: no
    BOS/EOS added (Megatron's `tokenize` adds none), and the special tokens Megatron appends (<CLS>, <SEP>, <EOD>,
    <MASK>, PAD/BOS/EOS when the model has none) at Megatron's ids; returns the file names written."""
    from tokenizers import AddedToken

    ours = SentencePieceTokenizer(model_file)
    backend = _unigram_from_sentencepiece(model_file) or _fast_tokenizer_from_sentencepiece(model_file)
    base = backend.get_vocab_size(with_added_tokens=False)
    added = [ours.inv_vocab[i] for i in range(base, ours.vocab_size)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    backend.save(os.path.join(out, "tokenizer.json"))
    special = {f"{k}_token": ours.inv_vocab[getattr(ours, k)] for k in ("bos", "eos", "pad", "cls", "sep", "mask")}
    _write_tokenizer_config(out, {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                                  "clean_up_tokenization_spaces": False})
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)
    differ = [p for p in PROBES if backend.encode(p).ids != ours.tokenize(p)]
    if differ:
        log(f"note: the exported tokenizer.json encodes {len(differ)} of {len(PROBES)} probe texts differently from "
            f"the training tokenizer (e.g. {differ[0]!r})")
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def _write_tokenizer_config(out: str, config: Dict[str, Any]) -> None:
    """tokenizer_config.json without model_max_length: the model's length is config.json's, and a tokenizer limit
    only makes transformers warn on every longer text (lm-eval tokenizes whole documents, then windows them)."""
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_generation_config(out: str, bos_id: Optional[int], eos_id: Optional[int]) -> List[str]:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id).save_pretrained(out)
    return ["generation_config.json"]


# --tokenizer-type -> the keys of the checkpoint's tokenizer record naming its files (each the destination of a flag)
_FILE_KEYS = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "BertWordPieceLowerCase": ("vocab_file",),
              "BertWordPieceCase": ("vocab_file",), "SentencePieceTokenizer": ("tokenizer_model",),
              "Llama2Tokenizer": ("tokenizer_model",), "HuggingFaceTokenizer": ("tokenizer_model",),
              "PretrainedFromHF": ("tokenizer_name_or_path",), "SFTTokenizer": ("tokenizer_model",)}
# (--tokenizer-type, the keys of the checkpoint's tokenizer record naming its files, their flags)
SOURCES = {tok: tuple((key, flag_spelling(key)) for key in keys) for tok, keys in _FILE_KEYS.items()}

PATH_KEYS = ("vocab_file", "merge_file", "tokenizer_model", "tokenizer_name_or_path")


def _check_sources(tok_type: str, meta_tokenizer: Dict[str, Any]) -> None:
    """One line when the files the checkpoint's tokenizer was built from are not here."""
    for key, flag in SOURCES[tok_type]:
        path = meta_tokenizer.get(key)
        hub_name = tok_type == "PretrainedFromHF" and path and not os.path.isabs(path) and not os.path.exists(path)
        if path and (os.path.exists(path) or hub_name):
            continue
        where = f"{flag} {path}, which is not here" if path else f"no {flag}"
        raise ConversionError(f"--saver hf: the checkpoint's tokenizer (--tokenizer-type {tok_type}) has {where}: "
                              "the Hugging Face folder needs its files; put them at that path and convert again")


def _export_gpt2(meta_tokenizer: Dict[str, Any], out: str) -> Dict[str, Any]:
    with open(meta_tokenizer["vocab_file"], encoding="utf-8") as f:
        eod = json.load(f).get("<|endoftext|>")
    _write_tokenizer_config(out, {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                                  "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                                  "add_prefix_space": False, "add_bos_token": False})
    return {"files": ["tokenizer_config.json"], "bos_token_id": eod, "eos_token_id": eod}


def _export_wordpiece(tok_type: str, out: str) -> Dict[str, Any]:
    """BertTokenizer over the copied vocab.txt, with the [BOS] / [EOS] Megatron appends after the vocabulary."""
    _write_tokenizer_config(out, {"tokenizer_class": "BertTokenizer", "do_lower_case": tok_type.endswith("LowerCase"),
                                  "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                                  "cls_token": "[CLS]", "mask_token": "[MASK]",
                                  "additional_special_tokens": ["[BOS]", "[EOS]"]})
    return {"files": ["tokenizer_config.json"], "bos_token_id": None, "eos_token_id": None}


def _export_hf(tok_type: str, meta_tokenizer: Dict[str, Any], out: str, log: Any) -> Dict[str, Any]:
    """The training run's Hugging Face tokenizer (a folder, or a hub name in the local cache) saved into `out`; a
    hub name that is not in the cache is a one-line note saying how to add its files."""
    cls = PretrainedFromHFTokenizer if tok_type == "PretrainedFromHF" else HuggingFaceTokenizer
    key, flag = SOURCES[tok_type][0]
    name = meta_tokenizer[key]
    try:
        hf = cls(name).hf_tokenizer
    except TokenizerLoadError:
        if os.path.isdir(name):
            raise
        log(f"note: no tokenizer files written: the training tokenizer ({flag} {name}) is not in the local Hugging "
            f"Face cache; add them with AutoTokenizer.from_pretrained({name!r}).save_pretrained(<--save-dir>)")
        return {"files": [], "bos_token_id": None, "eos_token_id": None}
    fmt = PROMPT_FORMATS.get(meta_tokenizer.get("sft_tokenizer_prompt_format") or "")
    if tok_type == "SFTTokenizer" and fmt is not None and fmt.template is not None:
        hf.chat_template = fmt.template  # the prompt format the model was finetuned with
    written = [os.path.basename(f) for f in hf.save_pretrained(out) if os.path.isfile(f)]
    return {"files": sorted(set(written)), "bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id}


def export_tokenizer(meta_tokenizer: Dict[str, Any], out: str, log: Any = print) -> Dict[str, Any]:
    """The tokenizer files AutoTokenizer needs beyond the copied originals (every --tokenizer-type but
    NullTokenizer), and the BOS/EOS ids for config.json / generation_config.json; a one-line ConversionError when
    the training tokenizer's files are missing."""
    tok_type = meta_tokenizer.get("type")
    if meta_tokenizer.get("files"):  # a HF source: its files are copied into `out` already; relative names are theirs
        meta_tokenizer = {k: os.path.join(out, v) if k in PATH_KEYS and isinstance(v, str) and not os.path.isabs(v)
                          else v for k, v in meta_tokenizer.items()}
    if tok_type not in SOURCES:
        why = "NullTokenizer has none" if tok_type == "NullTokenizer" else "the checkpoint names no tokenizer"
        log(f"note: no tokenizer files written ({why}): AutoTokenizer cannot load --save-dir; add the tokenizer's "
            "files there")
        return {"files": [], "bos_token_id": None, "eos_token_id": None}
    _check_sources(tok_type, meta_tokenizer)
    if tok_type == "GPT2BPETokenizer":
        return _export_gpt2(meta_tokenizer, out)
    if tok_type.startswith("BertWordPiece"):
        return _export_wordpiece(tok_type, out)
    if tok_type in ("HuggingFaceTokenizer", "PretrainedFromHF", "SFTTokenizer"):
        return _export_hf(tok_type, meta_tokenizer, out, log)
    model = meta_tokenizer["tokenizer_model"]
    if tok_type == "SentencePieceTokenizer":
        ours = SentencePieceTokenizer(model)
        ids = {"bos_token_id": ours.bos, "eos_token_id": ours.eod}
        export = export_sentencepiece_tokenizer
    else:
        sp = _training_tokenizer(model).sp_model
        ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id()}
        export = export_llama2_tokenizer
    try:
        return {"files": export(model, out, log), **ids}
    except (ImportError, ValueError, RuntimeError, OSError) as exc:
        log(f"note: no tokenizer.json written (tokenizer.model is there): {str(exc).splitlines()[0][:200]}")
        return {"files": [], **ids}


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
