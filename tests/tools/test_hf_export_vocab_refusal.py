"""`convert.py --saver hf --true-vocab-size N` with N below the tokenizer's vocabulary is one line and writes nothing
(it used to write a folder whose tokenizer produces ids the model has no embedding row for)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from megatron.checkpoint.conversion.driver import convert, parse_args
from megatron.checkpoint.conversion.hf_format import check_vocab_covers_tokenizer
from megatron.checkpoint.conversion.hf_tokenizer_export import tokenizer_vocab_size
from megatron.checkpoint.conversion.interchange import ConversionError, messages_from_state_dict
from megatron.checkpoint.conversion.megatron_format import write_megatron
from tests.tools.checkpoint_convert_helpers import TRUE_VOCAB, build, config, meta_for


def _vocab_json(folder: Path, entries: int) -> Path:
    """A GPT-2 style vocab.json of `entries` ids (the last one <|endoftext|>) with an (empty) merges.txt beside it."""
    path = folder / "vocab.json"
    path.write_text(json.dumps({**{f"t{i}": i for i in range(entries - 1)}, "<|endoftext|>": entries - 1}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return path


def test_tokenizer_vocab_size_of_the_copied_files(tmp_path: Path) -> None:
    vocab = _vocab_json(tmp_path, 70)
    assert tokenizer_vocab_size({"type": "GPT2BPETokenizer", "vocab_file": str(vocab)}) == (70, str(vocab))
    hf = tmp_path / "hf_tok"
    hf.mkdir()
    (hf / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}},
                                                   "added_tokens": [{"id": 5, "content": "<eos>"}]}))
    assert tokenizer_vocab_size({"type": "HuggingFaceTokenizer", "tokenizer_model": str(hf)}) == \
        (6, str(hf / "tokenizer.json"))
    assert tokenizer_vocab_size({"type": "GPT2BPETokenizer", "vocab_file": str(tmp_path / "gone.json")}) is None
    assert tokenizer_vocab_size({}) is None


def test_check_vocab_covers_tokenizer(tmp_path: Path) -> None:
    vocab = _vocab_json(tmp_path, 70)
    meta = dataclasses.replace(meta_for(config("gpt2"), true_vocab=61),
                               tokenizer={"type": "GPT2BPETokenizer", "vocab_file": str(vocab)})
    with pytest.raises(ConversionError) as info:
        check_vocab_covers_tokenizer(meta)
    assert str(info.value) == (f"--true-vocab-size 61 is smaller than the tokenizer's vocabulary (70 ids in {vocab}): "
                               "the exported model would have no embedding row for ids >= 61; pass "
                               "--true-vocab-size 70 (or drop it)")
    check_vocab_covers_tokenizer(dataclasses.replace(meta, true_vocab_size=70))  # equal: fine
    check_vocab_covers_tokenizer(dataclasses.replace(meta, true_vocab_size=None))  # all rows kept: fine


def test_convert_refuses_and_writes_nothing(tmp_path: Path) -> None:
    cfg = config("gpt2")
    vocab = _vocab_json(tmp_path, 64)
    meta = dataclasses.replace(meta_for(cfg, true_vocab=None), checkpoint_args=argparse.Namespace(
        tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(tmp_path / "merges.txt")))
    write_megatron(meta, messages_from_state_dict(build(cfg).state_dict(), cfg.num_layers), str(tmp_path / "src"),
                   1, 1, None)
    argv = ["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir", str(tmp_path / "src"),
            "--save-dir", str(tmp_path / "hf")]
    with pytest.raises(ConversionError, match=f"--true-vocab-size {TRUE_VOCAB} is smaller than the tokenizer's "
                                              r"vocabulary \(64 ids"):
        convert(parse_args(argv + ["--true-vocab-size", str(TRUE_VOCAB)]))
    assert not (tmp_path / "hf").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")] == []
    assert convert(parse_args(argv + ["--true-vocab-size", "64"]))["vocab_size"] == 64
