"""Train a small Llama-style SentencePiece model (`tokenizer.model`) on JSON-lines text.

Llama's settings: BPE with byte fallback, `<unk>`=0, `<s>`=1 (BOS), `</s>`=2 (EOS), no padding piece, digits split,
no normalisation (identity, whitespace kept), the dummy "▁" prefix. `--tokenizer-type Llama2Tokenizer
--tokenizer-model <output-dir>/tokenizer.model` reads it (`[bos] + ids`, `--append-eod` ends documents with `</s>`),
and `convert.py --saver hf` exports it so that AutoTokenizer gives the same ids. The Llama leg of the quick-start uses
it so that it needs nothing but the repository; for real runs use the model's released tokenizer.model.

    python tools/train_sentencepiece_tokenizer.py --input examples/data/python_docs.jsonl --vocab-size 2000 \
        --output-dir out/llama_tokenizer
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator


def _texts(paths: list[str], key: str) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)[key]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    sys.exit(f"{path}:{lineno}: cannot read key '{key}' ({exc.__class__.__name__}: {exc})")


def train(inputs: list[str], vocab_size: int, output_dir: str, json_key: str = "text") -> Path:
    """Train and write `<output_dir>/tokenizer.model`; returns its path."""
    import sentencepiece

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = list(_texts(inputs, json_key))
    if not texts:
        sys.exit(f"{', '.join(inputs)}: no text under key '{json_key}'")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(out / "tokenizer"), vocab_size=vocab_size, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, character_coverage=0.99995, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        max_sentence_length=1 << 20, num_threads=2, minloglevel=2)
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    return out / "tokenizer.model"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="JSON-lines file(s)")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    try:
        path = train(args.input, args.vocab_size, args.output_dir, args.json_key)
    except RuntimeError as exc:  # sentencepiece's own complaints, e.g. a vocabulary too large for the text
        sys.exit(f"train_sentencepiece_tokenizer.py: {str(exc).strip().splitlines()[-1]}")
    print(f"wrote {path} ({args.vocab_size} pieces; <unk>=0, <s>=1, </s>=2)")


if __name__ == "__main__":
    main()
