"""Fixtures for the end-to-end training tests: a small GPT corpus preprocessed once per session."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

NUM_DOCS = 100  # ~130k tokens of openwebtext-1000 with the 5,000-entry GPT-2 vocab


@pytest.fixture(scope="session")
def gpt_data(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Tokenise the first NUM_DOCS openwebtext documents into an mmap .bin/.idx pair (one document per line)."""
    from megatron.data.indexed_dataset import index_file_path, make_builder
    from megatron.tokenizer import build_tokenizer

    owt = shared_data / "openwebtext-1000"
    vocab, merges = owt / "gpt2-tiny-vocab.json", owt / "gpt2-tiny-merges.txt"
    tok_args = argparse.Namespace(
        tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges), tokenizer_model=None,
        tokenizer_name_or_path=None, vocab_size=None, vocab_extra_ids=0, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1, rank=0)
    tokenizer = build_tokenizer(tok_args)
    out_dir = tmp_path_factory.mktemp("gpt_data")
    prefix = str(out_dir / "owt_text_document")
    builder = make_builder(prefix + ".bin", impl="mmap", vocab_size=tokenizer.vocab_size)
    with open(owt / "openwebtext-1000.jsonl") as f:
        for i, line in enumerate(f):
            if i >= NUM_DOCS:
                break
            ids = tokenizer.tokenize(json.loads(line)["text"]) + [tokenizer.eod]
            builder.add_item(np.asarray(ids, dtype=np.int64))
            builder.end_document()
    builder.finalize(index_file_path(prefix))
    return {"prefix": prefix, "vocab": str(vocab), "merges": str(merges), "dir": out_dir}
