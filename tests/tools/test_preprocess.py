"""tools/preprocess_data.py and tools/preprocess_data_many_cores.py: Megatron semantics, determinism, bad input."""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.data import preprocessing
from megatron.data.indexed_dataset import MMapIndexedDataset, make_dataset
from megatron.data.sentence_splitter import SentenceSplitter
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from tests.fixtures import FIXTURES

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(shared_data: Path) -> dict:
    d = shared_data / "openwebtext-1000"
    return {"vocab": str(d / "gpt2-tiny-vocab.json"), "merges": str(d / "gpt2-tiny-merges.txt"),
            "owt": d / "openwebtext-1000.jsonl"}


@pytest.fixture(scope="module")
def tiny_tok(tiny) -> GPT2BPETokenizer:
    return GPT2BPETokenizer(tiny["vocab"], tiny["merges"])


@pytest.fixture
def small_tasks(monkeypatch):
    """Tasks of ~4 KiB so that a few hundred KB of input is spread over many tasks and workers."""
    monkeypatch.setattr(preprocessing, "MIN_TASK_BYTES", 4096)


def _gpt2_flags(tiny: dict, inputs, prefix, *extra) -> list:
    inputs = [str(p) for p in (inputs if isinstance(inputs, (list, tuple)) else [inputs])]
    return ["--input", *inputs, "--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", tiny["vocab"], "--merge-file", tiny["merges"], *map(str, extra)]


def _run(argv, tool=preprocessing.run) -> int:
    return preprocessing.main(tool, argv)


def _files(prefix) -> tuple:
    return Path(str(prefix) + ".bin").read_bytes(), Path(str(prefix) + ".idx").read_bytes()


def _head(src: Path, dst: Path, n: int) -> Path:
    with open(src, encoding="utf-8") as f:
        dst.write_text("".join(f.readline() for _ in range(n)), encoding="utf-8")
    return dst


def test_openwebtext_1000_as_subprocess_without_torch(tmp_path, tiny, wide_data):
    """The reference count: 1,000 documents, 1,361,845 tokens (the shipped 200: 302,412), each ending in eod 4999."""
    prefix = tmp_path / "owt"
    owt = wide_data / "openwebtext-1000" / "openwebtext-1000.jsonl"
    cmd = [sys.executable, "-X", "importtime", str(REPO / "tools" / "preprocess_data.py"),
           *_gpt2_flags(tiny, owt, prefix, "--append-eod", "--workers", "2", "--log-interval", "100")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {ln.split("|")[-1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    assert "torch" not in imported and "megatron.tokenizer" in imported
    assert re.search(r"Processed \d+ documents \([\d.]+ docs/s, [\d.]+ MB/s\)\.", proc.stderr)
    ds = MMapIndexedDataset(str(prefix) + "_text_document")
    docs, tokens = (200, 302_412) if wide_data == FIXTURES else (1000, 1_361_845)
    assert len(ds) == docs and int(ds.sizes.sum()) == tokens
    assert ds.dtype == np.uint16 and list(ds.doc_idx) == list(range(docs + 1))
    assert all(int(ds[i][-1]) == 4999 for i in range(len(ds)))


def test_document_level_matches_tokenizer(tmp_path, tiny, tiny_tok, small_tasks):
    src = _head(tiny["owt"], tmp_path / "in.jsonl", 60)
    assert _run(_gpt2_flags(tiny, src, tmp_path / "a", "--append-eod")) == 0
    ds = MMapIndexedDataset(str(tmp_path / "a_text_document"))
    texts = [json.loads(line)["text"] for line in src.read_text(encoding="utf-8").splitlines()]
    assert len(ds) == 60
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tiny_tok.tokenize(text) + [4999]


@pytest.mark.slow  # preprocess_data.py's worker pool
def test_workers_and_many_cores_identical(tmp_path, tiny, small_tasks):
    src = _head(tiny["owt"], tmp_path / "in.jsonl", 150)
    outs = []
    for name, tool, workers in (("w1", preprocessing.run, 1), ("w2", preprocessing.run, 2),
                                ("m1", preprocessing.run_partitioned, 1), ("m3", preprocessing.run_partitioned, 3)):
        assert _run(_gpt2_flags(tiny, src, tmp_path / name, "--append-eod", "--workers", workers,
                                "--chunk-size", 7), tool) == 0
        outs.append(_files(tmp_path / f"{name}_text_document"))
    assert all(o == outs[0] for o in outs[1:])
    assert sorted(p.name for p in tmp_path.iterdir() if ".part" in p.name or ".tmp" in p.name) == []


def test_sentence_level(tmp_path, tiny, tiny_tok):
    src = _head(tiny["owt"], tmp_path / "in.jsonl", 20)
    with open(src, "a", encoding="utf-8") as f:  # a pre-split document (JSON list) and an empty one
        f.write(json.dumps({"text": ["First sentence.", "", "Second one."]}) + "\n")
        f.write(json.dumps({"text": ""}) + "\n")
    assert _run(_gpt2_flags(tiny, src, tmp_path / "s", "--split-sentences", "--append-eod")) == 0
    ds = MMapIndexedDataset(str(tmp_path / "s_text_sentence"))
    splitter = SentenceSplitter()
    docs = [json.loads(line)["text"] for line in src.read_text(encoding="utf-8").splitlines()]
    expected_docs = []
    for text in docs:
        sentences = text if isinstance(text, list) else splitter(text)
        ids = [tiny_tok.tokenize(s) for s in sentences]
        ids = [s for s in ids if s]
        if ids:
            ids[-1] = ids[-1] + [4999]
            expected_docs.append(ids)
    assert len(expected_docs) == 21  # the empty document is skipped
    assert len(ds.doc_idx) == 22
    got = [[ds[j].tolist() for j in range(ds.doc_idx[d], ds.doc_idx[d + 1])] for d in range(21)]
    assert got == expected_docs
    assert sum(len(d) for d in expected_docs) > 21  # really split into sentences


def test_keep_newlines_and_multiple_keys(tmp_path, tiny, tiny_tok):
    src = tmp_path / "k.jsonl"
    src.write_text(json.dumps({"text": "One here.\n\nTwo here.", "title": "A title"}) + "\n"
                   + json.dumps({"text": "Three.", "title": ""}) + "\n", encoding="utf-8")
    assert _run(_gpt2_flags(tiny, src, tmp_path / "k", "--split-sentences", "--keep-newlines",
                            "--json-keys", "text", "title")) == 0
    text = MMapIndexedDataset(str(tmp_path / "k_text_sentence"))
    title = MMapIndexedDataset(str(tmp_path / "k_title_sentence"))
    assert tiny_tok.detokenize(text[0]) == "One here.\n\n" and tiny_tok.detokenize(text[1]) == "Two here."
    assert len(text.doc_idx) == 3 and len(title) == 1 and len(title.doc_idx) == 2  # empty title skipped


@pytest.mark.parametrize("impl", ["lazy", "cached"])
def test_legacy_impls(tmp_path, tiny, tiny_tok, impl):
    src = _head(tiny["owt"], tmp_path / "in.jsonl", 5)
    assert _run(_gpt2_flags(tiny, src, tmp_path / impl, "--dataset-impl", impl, "--append-eod")) == 0
    ds = make_dataset(str(tmp_path / f"{impl}_text_document"), impl)
    first = json.loads(src.read_text(encoding="utf-8").splitlines()[0])["text"]
    assert len(ds) == 5 and list(ds[0]) == tiny_tok.tokenize(first) + [4999]


@pytest.mark.slow  # preprocess_data.py's worker pool
def test_gz_and_glob_inputs(tmp_path, tiny, small_tasks):
    lines = tiny["owt"].read_text(encoding="utf-8").splitlines(keepends=True)[:40]
    (tmp_path / "shard_0.jsonl").write_text("".join(lines[:25]), encoding="utf-8")
    with gzip.open(tmp_path / "shard_1.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(lines[25:]))
    (tmp_path / "all.jsonl").write_text("".join(lines), encoding="utf-8")
    assert _run(_gpt2_flags(tiny, tmp_path / "all.jsonl", tmp_path / "ref")) == 0
    assert _run(_gpt2_flags(tiny, str(tmp_path / "shard_*"), tmp_path / "glob", "--workers", 2)) == 0
    assert _run(_gpt2_flags(tiny, [tmp_path / "shard_0.jsonl", tmp_path / "shard_1.jsonl.gz"], tmp_path / "many",
                            "--workers", 2), preprocessing.run_partitioned) == 0
    ref = _files(tmp_path / "ref_text_document")
    assert _files(tmp_path / "glob_text_document") == ref == _files(tmp_path / "many_text_document")


BAD_LINES = {
    "json": (b'{"text": "unterminated\n', "malformed JSON"),
    "key": (b'{"body": "no text key"}\n', "missing key 'text'"),
    "type": (b'{"text": 42}\n', "key 'text' is int, expected a string"),
    "utf8": (b'{"text": "caf\xe9 latin-1"}\n', "invalid UTF-8"),
    "surrogate": (b'{"text": "lone \\ud800 surrogate"}\n', "key 'text' holds a lone surrogate"),
}


def test_json_that_only_python_json_accepts(tmp_path, tiny, tiny_tok):
    """orjson rejects NaN; Megatron's json.loads accepts it, so such a line is a valid document."""
    src = tmp_path / "nan.jsonl"
    src.write_bytes(b'{"text": "Hello there.", "score": NaN}\n')
    assert _run(_gpt2_flags(tiny, src, tmp_path / "nan")) == 0
    assert MMapIndexedDataset(str(tmp_path / "nan_text_document"))[0].tolist() == tiny_tok.tokenize("Hello there.")


@pytest.mark.slow  # preprocess_data.py's worker pool
@pytest.mark.parametrize("tool", ["run", "run_partitioned"])
@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_lines(tmp_path, tiny, capsys, case, tool):
    bad, reason = BAD_LINES[case]
    good = b'{"text": "Hello there."}\n'
    src = tmp_path / "bad.jsonl"
    src.write_bytes(good + good + bad + good)
    fn = getattr(preprocessing, tool)
    capsys.readouterr()
    assert _run(_gpt2_flags(tiny, src, tmp_path / "out", "--workers", 2), fn) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {src}:3: {reason}") and "--skip-bad-lines" in err[-1]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("out")]  # nothing published, no temp files
    assert _run(_gpt2_flags(tiny, src, tmp_path / "out", "--skip-bad-lines", "--workers", 2), fn) == 0
    err = capsys.readouterr().err
    assert "Skipped 1 bad lines" in err and f"{src}:3: {reason}" in err
    ds = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert len(ds) == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == [
        "out_text_document.bin", "out_text_document.idx"]


def test_bad_line_as_subprocess_is_one_line(tmp_path, tiny):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"text": "ok"}\n[1, 2]\n')
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"),
                           *_gpt2_flags(tiny, src, tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {src}:2: expected a JSON object, got list (use --skip-bad-lines to skip bad lines)")
    assert "Traceback" not in proc.stderr


def test_interrupted_run_publishes_nothing(tmp_path, tiny, monkeypatch):
    src = _head(tiny["owt"], tmp_path / "in.jsonl", 10)
    (tmp_path / "out_text_document.idx").write_bytes(b"stale")  # from an older run

    def boom(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(preprocessing.Writers, "add", boom)
    assert _run(_gpt2_flags(tiny, src, tmp_path / "out")) == 130
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out_text_document.idx"]


def test_other_tokenizers_and_flag_errors(tmp_path, shared_data, capsys):
    src = tmp_path / "n.jsonl"
    src.write_text('{"text": "1 2 3"}\n{"text": "7"}\n', encoding="utf-8")
    assert _run(["--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", "10", "--append-eod"]) == 0
    ds = MMapIndexedDataset(str(tmp_path / "n_text_document"))
    assert [ds[0].tolist(), ds[1].tolist()] == [[1, 2, 3, 10], [7, 10]]
    vocab = str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt")
    assert _run(["--input", str(src), "--output-prefix", str(tmp_path / "b"), "--tokenizer-type",
                 "BertWordPieceLowerCase", "--vocab", vocab, "--split-sentences"]) == 0
    assert MMapIndexedDataset(str(tmp_path / "b_text_sentence"))[0].tolist() == [1015, 1016, 1017]
    capsys.readouterr()
    assert _run(["--input", str(src), "--output-prefix", str(tmp_path / "b2"), "--tokenizer-type",
                 "BertWordPieceLowerCase", "--vocab", vocab, "--append-eod"]) == 1
    assert "--append-eod" in capsys.readouterr().err
    assert _run(["--input", str(tmp_path / "missing*.jsonl"), "--output-prefix", str(tmp_path / "x"),
                 "--tokenizer-type", "NullTokenizer"]) == 1
    assert "matches no file" in capsys.readouterr().err
    assert _run(["--input", str(src), "--output-prefix", str(tmp_path / "nodir" / "x"),
                 "--tokenizer-type", "NullTokenizer"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert _run(["--input", str(src), "--output-prefix", str(tmp_path / "g"), "--tokenizer-type",
                 "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "nope.json"), "--merge-file", "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.json" in err[0]
    assert not os.path.exists(tmp_path / "g_text_document.bin")


@pytest.mark.slow  # preprocess_data.py's worker pool
def test_bert_fast_path_output_is_byte_identical_to_reference(tmp_path, shared_data, monkeypatch):
    """--split-sentences with BertWordPieceLowerCase: the fast Punkt engine + WordPiece fast path + numpy packing write
    the same .bin/.idx bytes as NLTK's Punkt + the tokenizers engine + per-sentence lists (the reference path)."""
    import functools

    from megatron.data import sentence_splitter
    from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

    pytest.importorskip("nltk")
    src = _head(shared_data / "openwebtext-1000" / "openwebtext-1000.jsonl", tmp_path / "in.jsonl", 150)
    with open(src, "a", encoding="utf-8") as f:  # pre-split, empty, non-ASCII and control-character documents
        for text in (["Already split.", "", "Yes!"], "", "   ", "Caf\u00e9 \u00fcber na\u00efve. \u4e2d\u6587 ok.",
                     "\u201cQuoted.\u201d Then\x0bmore\x01text\u2026 done. \u00a3 5.", "!!!", ["", ""]):
            f.write(json.dumps({"text": text}) + "\n")
    vocab = str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt")
    flags = ["--input", str(src), "--tokenizer-type", "BertWordPieceLowerCase", "--vocab", vocab,
             "--split-sentences", "--allow-empty"]
    assert _run([*flags, "--output-prefix", str(tmp_path / "fast"), "--workers", "2"]) == 0
    monkeypatch.setattr(sentence_splitter, "SentenceSplitter",
                        functools.partial(sentence_splitter.SentenceSplitter, engine="nltk"))
    monkeypatch.setattr(BertWordPieceTokenizer, "tokenize_flat", None)
    monkeypatch.setattr(BertWordPieceTokenizer, "tokenize_batch", BertWordPieceTokenizer.tokenize_batch_reference)
    assert _run([*flags, "--output-prefix", str(tmp_path / "ref")]) == 0
    fast, ref = _files(tmp_path / "fast_text_sentence"), _files(tmp_path / "ref_text_sentence")
    assert fast == ref
    ds = MMapIndexedDataset(str(tmp_path / "ref_text_sentence"))
    assert len(ds.doc_idx) - 1 == 154 and len(ds) > 10 * 150  # 3 documents without tokens skipped, many sentences


def test_pack_flat_equals_pack(shared_data):
    """Encoder._pack_flat (numpy) and _pack (lists) agree, with empty sentences, empty documents and an eod token."""
    import argparse

    rng = np.random.default_rng(0)
    args = argparse.Namespace(json_keys=["text"], tokenizer_type="BertWordPieceLowerCase", append_eod=False,
                              vocab_file=str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt"),
                              dataset_impl="mmap", split_sentences=False, rank=1, make_vocab_size_divisible_by=128,
                              tensor_model_parallel_size=1, vocab_extra_ids=0)
    enc = preprocessing.Encoder(args)
    for eod in (None, 7):
        enc.eod = eod
        counts = rng.integers(0, 5, size=60).tolist()
        lengths = rng.integers(0, 4, size=sum(counts)) * rng.integers(0, 2, size=sum(counts))
        ids = rng.integers(0, 30000, size=int(lengths.sum()))
        lists, pos = [], 0
        for n in lengths.tolist():
            lists.append(ids[pos:pos + n].tolist())
            pos += n
        a, b = enc._pack_flat(ids, lengths, counts), enc._pack(lists, counts)
        assert a.empty_docs == b.empty_docs > 0 and a.tokens.dtype == b.tokens.dtype
        for x, y in zip(a[:3], b[:3]):
            assert x.tolist() == y.tolist()
