"""Llama-family tokenizers: `Llama2Tokenizer` (SentencePiece) and `HuggingFaceTokenizer` (tokenizer.json) give the ids of
Hugging Face's tokenizers built from the same files, on every line of the WikiText-103, LAMBADA, OpenWebText files.

The SentencePiece model is trained here, offline, with Llama's recipe (BPE, byte fallback, split digits, identity
normalization, unk/bos/eos = 0/1/2); the tokenizer.json is trained here with the `tokenizers` library.
"""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import List

import numpy as np
import pytest

from megatron.tokenizer import build_tokenizer
from tests.tokenizer.llama_files import train_llama_sentencepiece, training_text

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lines(wide_data: Path) -> List[str]:
    out = (wide_data / "wikitext-103" / "wiki.test.tokens").read_text(encoding="utf-8").splitlines(keepends=True)
    for name in ("lambada/lambada_test.jsonl", "openwebtext-1000/openwebtext-1000.jsonl"):
        with open(wide_data / name, encoding="utf-8") as f:
            out += [json.loads(line)["text"] for line in f]
    out += ["", " ", "  two leading", "trailing  ", "\ttab\n\nnew lines", "digits 2024-11-23 3.14159", "café 😀 Ω",
            "literal <s> and </s> and <unk> are text"]
    return out


@pytest.fixture(scope="module")
def llama_sp_dir(tmp_path_factory, shared_data: Path) -> Path:
    """A folder holding a Llama-style `tokenizer.model` (2,000 pieces, trained in ~0.2 s)."""
    return train_llama_sentencepiece(tmp_path_factory.mktemp("llama_sp"), shared_data).parent


@pytest.fixture(scope="module")
def hf_json_dir(tmp_path_factory, shared_data: Path) -> Path:
    """A folder with a byte-level BPE `tokenizer.json` whose post-processor adds BOS (as Llama-3's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = tmp_path_factory.mktemp("hf_json")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(shared_data), trainer=trainer)
    bos = tok.token_to_id(specials[0])
    tok.post_processor = processors.TemplateProcessing(single=f"{specials[0]} $A", pair=f"{specials[0]} $A $B",
                                                       special_tokens=[(specials[0], bos)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[1]}))
    return out


def _llama2(model_dir: Path, **kw):
    return build_tokenizer(types.SimpleNamespace(tokenizer_type="Llama2Tokenizer",
                                                 tokenizer_model=str(model_dir / "tokenizer.model"), **kw))


@pytest.mark.slow  # a whole-file sweep (tens of CPU seconds): CI runs it, the quick lane does not
def test_llama2_tokenizer_matches_hf_on_every_line(llama_sp_dir, lines):
    import sentencepiece
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    tok = _llama2(llama_sp_dir)
    ours = tok.tokenize_batch(lines)
    assert (tok.vocab_size, tok.bos, tok.eos, tok.eod) == (2000, 1, 2, 2)
    assert (tok.cls, tok.sep, tok.mask, tok.additional_special_tokens_ids) == (-1, -1, -1, None)
    assert [tok.tokenize(t) for t in lines[:: 50]] == ours[:: 50]
    assert tok.tokenize("a b", bos=False, eos=True) == tok.tokenize("a b")[1:] + [2]
    # Meta's reference: [bos] + sentencepiece ids (a literal "<s>" in the text is text)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(llama_sp_dir / "tokenizer.model"))
    assert ours == [[sp.bos_id(), *ids] for ids in sp.encode(lines)]
    assert ours[-1][:2] != [1, 1] and 1 not in ours[-1][1:] and 2 not in ours[-1]
    # transformers' SentencePiece-backed Llama tokenizer (the "slow" LlamaTokenizer, legacy mode) on every line
    slow = SentencePieceBackend(vocab_file=str(llama_sp_dir / "tokenizer.model"), legacy=True, unk_token="<unk>",
                                bos_token="<s>", eos_token="</s>")
    ref = slow(lines, split_special_tokens=True)["input_ids"]
    assert ours == [[slow.bos_token_id, *ids] for ids in ref]
    # transformers' LlamaTokenizer (tokenizers backend) from the same tokenizer.model, BOS added by HF itself. Its
    # Metaspace pre-tokenizer adds the dummy prefix only to text that does not already start with a space, where
    # SentencePiece always adds it, so lines starting with a space are compared above only.
    fast = LlamaTokenizer.from_pretrained(str(llama_sp_dir), add_bos_token=True)
    keep = [i for i, t in enumerate(lines) if not t.startswith((" ", "\t"))]
    assert len(keep) > len(lines) // 2
    ref = fast([lines[i] for i in keep], split_special_tokens=True)["input_ids"]
    mismatches = [i for i, r in zip(keep, ref) if ours[i] != r]
    assert not mismatches, f"{len(mismatches)} lines differ, first: {lines[mismatches[0]][:80]!r}"
    assert all(tok.detokenize(ours[i]) == fast.decode(ours[i], skip_special_tokens=True) for i in keep[:: 23])
    # lossless round trip (identity normalization + byte fallback)
    assert all(tok.detokenize(ids) == text for ids, text in zip(ours[:: 11], lines[:: 11]) if text.strip() == text)


def test_llama2_tokenizer_refusals(llama_sp_dir, shared_data, tmp_path):
    with pytest.raises(ValueError, match="has no BOS piece"):  # T5's model has no <s>
        build_tokenizer(types.SimpleNamespace(
            tokenizer_type="Llama2Tokenizer", tokenizer_model=str(shared_data / "t5-sentencepiece" / "spiece.model")))
    with pytest.raises(ValueError, match="--vocab-extra-ids 3 is not supported"):
        _llama2(llama_sp_dir, vocab_extra_ids=3)
    with pytest.raises(FileNotFoundError, match="--tokenizer-model .*missing.model: file not found"):
        build_tokenizer(types.SimpleNamespace(tokenizer_type="Llama2Tokenizer",
                                              tokenizer_model=str(tmp_path / "missing.model")))
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        build_tokenizer(types.SimpleNamespace(tokenizer_type="Llama2Tokenizer",
                                              tokenizer_model=str(tmp_path / "bad.model")))
    with pytest.raises(AttributeError, match="PAD is not provided"):
        _ = _llama2(llama_sp_dir).pad
    args = types.SimpleNamespace(tokenizer_type="Llama2Tokenizer", tokenizer_model=str(llama_sp_dir / "tokenizer.model"),
                                 make_vocab_size_divisible_by=128, tensor_model_parallel_size=2, rank=1)
    build_tokenizer(args)
    assert args.padded_vocab_size == 2048


@pytest.mark.slow  # a whole-file sweep (tens of CPU seconds): CI runs it, the quick lane does not
def test_huggingface_tokenizer_matches_tokenizers_on_every_line(hf_json_dir, lines):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = build_tokenizer(types.SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf_json_dir)))
    ref_tok = Tokenizer.from_file(str(hf_json_dir / "tokenizer.json"))
    ref = [e.ids for e in ref_tok.encode_batch(lines)]
    ours = tok.tokenize_batch(lines)
    assert ours == ref
    assert [tok.tokenize(t) for t in lines[:: 50]] == ref[:: 50]
    bos, eos = ref_tok.token_to_id("<|begin_of_text|>"), ref_tok.token_to_id("<|end_of_text|>")
    assert all(ids[0] == bos for ids in ours) and (tok.bos, tok.eod, tok.eos) == (bos, eos, eos)
    assert tok.vocab_size == ref_tok.get_vocab_size(with_added_tokens=True) == 1500
    # byte-level BPE round-trips byte-exactly, and decodes as the tokenizers library does
    assert all(tok.detokenize(ids[1:]) == text for ids, text in zip(ours[:: 5], lines[:: 5]))
    assert all(tok.detokenize(ids) == ref_tok.decode(ids, skip_special_tokens=False) for ids in ours[:: 41])
    # the same folder through PretrainedFromHF (--tokenizer-name-or-path) and transformers' AutoTokenizer
    other = build_tokenizer(types.SimpleNamespace(tokenizer_type="PretrainedFromHF",
                                                  tokenizer_name_or_path=str(hf_json_dir)))
    assert other.tokenize_batch(lines[:: 7]) == ref[:: 7]
    assert AutoTokenizer.from_pretrained(str(hf_json_dir))(lines[:: 7])["input_ids"] == ref[:: 7]
    with pytest.raises(ValueError, match="HuggingFaceTokenizer needs --tokenizer-model"):
        build_tokenizer(types.SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None))
    with pytest.raises(RuntimeError, match="^--tokenizer-model .*nothing: cannot load a tokenizer"):
        build_tokenizer(types.SimpleNamespace(tokenizer_type="HuggingFaceTokenizer",
                                              tokenizer_model=str(hf_json_dir / "nothing")))


def test_flags_and_preprocessing_without_torch(llama_sp_dir, hf_json_dir, tmp_path, shared_data):
    """The entry-point flags accept both types; tools/preprocess_data.py writes [bos] ids [eos] with --append-eod."""
    from megatron.arguments import parse_args, validate_args
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.errors import MegatronUserError

    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1"]
    for kind, model in (("Llama2Tokenizer", llama_sp_dir / "tokenizer.model"), ("HuggingFaceTokenizer", hf_json_dir)):
        args = parse_args(args=[*base, "--tokenizer-type", kind, "--tokenizer-model", str(model)])
        assert (args.tokenizer_type, args.tokenizer_model) == (kind, str(model))
        with pytest.raises(MegatronUserError, match="--tokenizer-model"):
            validate_args(parse_args(args=[*base, "--tokenizer-type", kind]))

    src = tmp_path / "in.jsonl"
    with open(shared_data / "lambada" / "lambada_test.jsonl", encoding="utf-8") as f:
        src.write_text("".join(next(f) for _ in range(40)), encoding="utf-8")
    texts = [json.loads(line)["text"] for line in src.read_text(encoding="utf-8").splitlines()]
    code = ("import sys, runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
            "assert 'torch' not in sys.modules, 'preprocess_data imported torch'")
    for kind, model, name in (("Llama2Tokenizer", llama_sp_dir / "tokenizer.model", "sp"),
                              ("HuggingFaceTokenizer", hf_json_dir, "hf")):
        cmd = [sys.executable, "-c", code, str(REPO / "tools" / "preprocess_data.py"), "--input", str(src),
               "--output-prefix", str(tmp_path / name), "--tokenizer-type", kind, "--tokenizer-model", str(model),
               "--append-eod", "--workers", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(REPO))
        assert proc.returncode == 0, proc.stderr[-2000:]
        ds = MMapIndexedDataset(str(tmp_path / f"{name}_text_document"))
        tok = build_tokenizer(types.SimpleNamespace(tokenizer_type=kind, tokenizer_model=str(model)))
        assert ds.dtype == np.uint16 and len(ds) == 40
        assert [ds[i].tolist() for i in range(40)] == [tok.tokenize(t) + [tok.eod] for t in texts]
        assert ds[0].tolist()[0] == tok.bos
