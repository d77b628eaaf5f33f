"""Entry point for downstream tasks (Megatron's tasks/main.py); today the zero-shot GPT tasks.

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens --tokenizer-type GPT2BPETokenizer \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --load CKPT --no-load-optim --no-load-rng \
        --micro-batch-size 8 --seq-length 1024 --max-position-embeddings 1024 --num-layers 24 --hidden-size 1024 \
        --num-attention-heads 16 [--overlapping-eval 32]
    python tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl [--strict-lambada] ...

    python tasks/main.py --task MNLI --train-data MNLI/train.tsv --valid-data MNLI/dev_matched.tsv \
        MNLI/dev_mismatched.tsv --pretrained-checkpoint checkpoints/bert_345m --tokenizer-type BertWordPieceLowerCase \
        --vocab-file bert-vocab.txt --epochs 5 --seq-length 512 --micro-batch-size 8 --lr 5e-5 ...   (also QQP, RACE)

Runs in one process or under torchrun (tensor, pipeline and data parallelism for the finetuning tasks).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.errors import exit_on_user_error  # noqa: E402
from megatron.initialize import initialize_megatron  # noqa: E402
from megatron.settings import RandomWeightsSettings, TasksSettings, add_group, flags_of  # noqa: E402


def get_tasks_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The tasks' own flags (declared in megatron/settings/tasks.py) and the random-weights opt-in."""
    return add_group(add_group(parser, TasksSettings), RandomWeightsSettings)


FINETUNE_TASKS = ("MNLI", "QQP", "RACE")
FINETUNE_FLAGS = {name: TasksSettings.__dataclass_fields__[name].default  # (their declared defaults)
                  for name in ("epochs", "pretrained_checkpoint", "train_data", "keep_last")}


def _task_from_argv(argv: Optional[list[str]]) -> Optional[str]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(*flags_of(TasksSettings, "task"), default=None)
    return pre.parse_known_args(sys.argv[1:] if argv is None else argv)[0].task


def check_task_flags(args: argparse.Namespace) -> None:
    """The zero-shot tasks refuse the finetuning flags with one line (nothing accepted is ignored)."""
    from megatron.errors import ArgumentError

    if args.task in FINETUNE_TASKS:
        if args.allow_random_weights and args.epochs:
            raise ArgumentError(f"--allow-random-weights is for evaluation (--epochs 0); finetuning --task {args.task} "
                                "starts from --pretrained-checkpoint, or from random weights without it: drop it")
        return
    for dest, default in FINETUNE_FLAGS.items():
        if getattr(args, dest, default) != default:
            raise ArgumentError(f"--{dest.replace('_', '-')} is for the finetuning tasks ({', '.join(FINETUNE_TASKS)}); "
                            f"--task {args.task} does not use it: drop it")


def main(argv: Optional[list[str]] = None) -> dict:
    finetuning = _task_from_argv(argv) in FINETUNE_TASKS
    defaults = ({"tokenizer_type": "BertWordPieceLowerCase", "model_family": "bert"} if finetuning
                else {"tokenizer_type": "GPT2BPETokenizer"})
    initialize_megatron(extra_args_provider=get_tasks_args, args_defaults=defaults, args=argv)
    from megatron import global_vars

    args = global_vars.get_args()
    check_task_flags(args)
    if args.task in ("LAMBADA", "WIKITEXT103"):
        from tasks.zeroshot_gpt.evaluate import main as zeroshot_main

        return zeroshot_main(args)
    if args.task in ("MNLI", "QQP"):
        from tasks.finetune_utils import finetune
        from tasks.glue.finetune import glue_task

        return finetune(glue_task(args.task, args), args)
    if args.task == "RACE":
        from tasks.finetune_utils import finetune
        from tasks.race.finetune import race_task

        return finetune(race_task(args), args)
    from tasks.zeroshot_gpt.evaluate import TaskError

    raise TaskError(f"--task {args.task} is not supported; use WIKITEXT103, LAMBADA, MNLI, QQP or RACE")


if __name__ == "__main__":
    exit_on_user_error(main)
