"""Ids identical to Hugging Face / sentencepiece on every line of WikiText-103 test, LAMBADA and OpenWebText.

The shipped fixture slices always; the full files instead when the full data set is present (`wide_data`).
"""
from __future__ import annotations

import json
import types
from pathlib import Path
from typing import List

import pytest

from megatron.tokenizer import build_tokenizer
from tests.fixtures import FIXTURES


def _corpus_lines(data: Path) -> List[str]:
    lines = (data / "wikitext-103" / "wiki.test.tokens").read_text(encoding="utf-8").splitlines(keepends=True)
    for name in ("lambada/lambada_test.jsonl", "openwebtext-1000/openwebtext-1000.jsonl"):
        with open(data / name, encoding="utf-8") as f:
            lines += [json.loads(line)["text"] for line in f]
    return lines


@pytest.fixture(scope="module")
def lines(wide_data: Path) -> List[str]:
    out = _corpus_lines(wide_data)
    assert len(out) == (530 + 500 + 200 if wide_data == FIXTURES else 4358 + 5153 + 1000)
    return out


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _gpt2_hf(vocab_file: Path, merge_file: Path):
    """GPT2TokenizerFast from the two files (transformers 5 ignores vocab_file=/merges_file=: pass the contents)."""
    from transformers import GPT2TokenizerFast

    if _transformers_major() < 5:
        return GPT2TokenizerFast(vocab_file=str(vocab_file), merges_file=str(merge_file))
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    merges = [tuple(ln.split()) for ln in merge_file.read_text(encoding="utf-8").split("\n")[1:] if ln]
    return GPT2TokenizerFast(vocab=vocab, merges=merges)


def _bert_hf(vocab_file: Path, lower: bool):
    from transformers import BertTokenizerFast

    if _transformers_major() < 5:
        return BertTokenizerFast(vocab_file=str(vocab_file), do_lower_case=lower)
    return BertTokenizerFast(vocab=str(vocab_file), do_lower_case=lower)


@pytest.mark.parametrize("folder,vocab,merges", [
    ("gpt2-bpe", "gpt2-vocab.json", "gpt2-merges.txt"),
    ("openwebtext-1000", "gpt2-tiny-vocab.json", "gpt2-tiny-merges.txt"),
])
def test_gpt2_bpe_matches_hf_on_every_line(shared_data, lines, folder, vocab, merges):
    vf, mf = shared_data / folder / vocab, shared_data / folder / merges
    tok = build_tokenizer(types.SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vf),
                                                merge_file=str(mf)))
    assert tok.engine.name == "tiktoken"  # the fast exact engine is used for GPT-2's files
    hf = _gpt2_hf(vf, mf)
    assert not any("<|endoftext|>" in t for t in lines)  # HF would map the literal to eod; Megatron does not
    ref = hf(lines, add_special_tokens=False)["input_ids"]
    ours = tok.tokenize_batch(lines)
    mismatches = [i for i, (a, b) in enumerate(zip(ours, ref)) if a != b]
    assert not mismatches, f"{len(mismatches)} lines differ, first: {lines[mismatches[0]][:80]!r}"
    assert sum(map(len, ours)) > (300_000 if len(lines) < 2000 else 1_000_000)
    assert tok.tokenize(lines[7]) == ref[7]
    # detokenize round-trips byte-exactly (byte-level BPE is lossless)
    assert all(tok.detokenize(ids) == text for ids, text in zip(ours, lines))
    assert tok.eod == tok.vocab["<|endoftext|>"] == (50256 if folder == "gpt2-bpe" else 4999)


@pytest.mark.slow  # a whole-file sweep (tens of CPU seconds): CI runs it, the quick lane does not
def test_bert_matches_hf_on_every_line(shared_data, lines):
    for kind, fname, lower in (("BertWordPieceLowerCase", "bert-base-uncased-vocab.txt", True),
                               ("BertWordPieceCase", "bert-base-cased-vocab.txt", False)):
        vf = shared_data / "bert-wordpiece" / fname
        tok = build_tokenizer(types.SimpleNamespace(tokenizer_type=kind, vocab_file=str(vf)))
        hf = _bert_hf(vf, lower)
        ref = hf(lines, add_special_tokens=False)["input_ids"]
        ours = tok.tokenize_batch(lines)
        mismatches = [i for i, (a, b) in enumerate(zip(ours, ref)) if a != b]
        assert not mismatches, f"{kind}: {len(mismatches)} lines differ, first: {lines[mismatches[0]][:80]!r}"
        # detokenize then tokenize again is a fixed point (WordPiece loses spacing/case, not tokens)
        sample = ours[:: 97]
        assert [tok.tokenize(tok.detokenize(ids)) for ids in sample] == sample


def test_sentencepiece_matches_sentencepiece_on_every_line(shared_data, lines):
    import sentencepiece

    model = shared_data / "t5-sentencepiece" / "spiece.model"
    tok = build_tokenizer(types.SimpleNamespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(model),
                                                vocab_extra_ids=100))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    ref = sp.encode(lines, out_type=int)
    ours = tok.tokenize_batch(lines)
    assert ours == ref
    assert [tok.tokenize(t) for t in lines[:200]] == ref[:200]
    assert all(tok.detokenize(ids) == sp.decode(ids) for ids in ours[:: 50])
