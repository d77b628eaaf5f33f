"""Tokenize JSON-lines text into Megatron's indexed dataset files (`{prefix}_{key}_{document|sentence}.bin/.idx`).

Same flags and output as Megatron-LM's tools/preprocess_data.py, e.g.

    python tools/preprocess_data.py --input data.jsonl --output-prefix out/my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --append-eod --workers 2

Imports only megatron.tokenizer and megatron.data (no torch), so it starts in a fraction of a second.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.preprocessing import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
