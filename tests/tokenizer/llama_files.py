"""Test helper: a Llama-style SentencePiece `tokenizer.model` trained offline in a fraction of a second."""
from __future__ import annotations

import io
from pathlib import Path
from typing import List


def training_text(data: Path) -> List[str]:
    """Non-empty lines of the shipped tinyshakespeare and WikiText-2 files."""
    text = (data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").splitlines()[:20000]
    wiki = (data / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8").splitlines()
    return [t for t in text + wiki if t.strip()]


def train_llama_sentencepiece(out: Path, data: Path, vocab_size: int = 2000) -> Path:
    """Llama's recipe (BPE, byte fallback, split digits, identity normalization, unk/bos/eos = 0/1/2, no pad)."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text(data)), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=0.9995,
        num_threads=1, minloglevel=2)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path
