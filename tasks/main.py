"""Entry point for downstream tasks (Megatron's tasks/main.py); today the zero-shot GPT tasks.

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens --tokenizer-type GPT2BPETokenizer \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --load CKPT --no-load-optim --no-load-rng \
        --micro-batch-size 8 --seq-length 1024 --max-position-embeddings 1024 --num-layers 24 --hidden-size 1024 \
        --num-attention-heads 16 [--overlapping-eval 32]
    python tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl [--strict-lambada] ...

Runs in one process or under torchrun (tensor and data parallelism).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.errors import exit_on_user_error  # noqa: E402
from megatron.initialize import initialize_megatron  # noqa: E402


def get_tasks_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's 'tasks' flag group."""
    g = parser.add_argument_group(title="tasks")
    g.add_argument("--task", type=str, required=True, help="Task name: WIKITEXT103 or LAMBADA.")
    g.add_argument("--epochs", type=int, default=None, help="Finetuning epochs (finetuning tasks).")
    g.add_argument("--pretrained-checkpoint", type=str, default=None, help="Pretrained checkpoint for finetuning.")
    g.add_argument("--keep-last", action="store_true", help="Keep the last batch (maybe incomplete) in the loader.")
    g.add_argument("--train-data", nargs="+", default=None, help="Training data files (finetuning tasks).")
    g.add_argument("--valid-data", nargs="*", default=None, help="Validation data file(s).")
    g.add_argument("--overlapping-eval", type=int, default=32,
                   help="Sliding-window stride for WIKITEXT103: only the last N tokens of each window are scored.")
    g.add_argument("--strict-lambada", action="store_true",
                   help="LAMBADA: tokenize the last word on its own and require all its tokens to be predicted.")
    return parser


def main(argv: Optional[list[str]] = None) -> dict:
    initialize_megatron(extra_args_provider=get_tasks_args, args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
                        args=argv)
    from megatron import global_vars

    args = global_vars.get_args()
    if args.task in ("LAMBADA", "WIKITEXT103"):
        from tasks.zeroshot_gpt.evaluate import main as zeroshot_main

        return zeroshot_main(args)
    from tasks.zeroshot_gpt.evaluate import TaskError

    raise TaskError(f"--task {args.task} is not supported; use WIKITEXT103 or LAMBADA")


if __name__ == "__main__":
    exit_on_user_error(main)
