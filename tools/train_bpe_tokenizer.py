"""Train a small GPT-2-style byte-level BPE tokenizer on JSON-lines text.

Writes `vocab.json` and `merges.txt` in the GPT-2 format that `--tokenizer-type GPT2BPETokenizer --vocab-file ...
--merge-file ...` reads, with `<|endoftext|>` as the end-of-document token. The quick-start uses it so that it needs
nothing but the repository; for real runs use the released GPT-2 files.

    python tools/train_bpe_tokenizer.py --input examples/data/python_docs.jsonl --vocab-size 4096 --output-dir out/tok
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


def train(inputs: list[str], vocab_size: int, output_dir: str, json_key: str = "text", min_frequency: int = 2) -> Path:
    """Train and save; returns the output directory."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(
        _texts(inputs, json_key),
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_model(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="JSON-lines file(s)")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    out = train(args.input, args.vocab_size, args.output_dir, args.json_key, args.min_frequency)
    vocab = json.loads((out / "vocab.json").read_text())
    print(f"wrote {out / 'vocab.json'} ({len(vocab)} tokens) and {out / 'merges.txt'}")


if __name__ == "__main__":
    main()
