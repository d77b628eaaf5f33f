"""The settings tasks/main.py and tasks/eval_harness/evaluate.py add to Megatron's (their own --help groups)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, List, Optional

from megatron.settings.declare import setting


def _limit(value: str) -> float:
    """--limit: a count of documents (an integer >= 1) or a fraction of them (< 1)."""
    number = float(value)
    return int(number) if number.is_integer() and number >= 1 else number


@dataclasses.dataclass
class TasksSettings:
    """--help group "tasks"."""

    TITLE: ClassVar[str] = "tasks"
    task: Optional[str] = setting("--task", required=True, help="Task name: WIKITEXT103, LAMBADA, MNLI, QQP or RACE.",
        read_by="tasks/main.py")
    epochs: Optional[int] = setting("--epochs", help="Finetuning epochs (finetuning tasks).",
        read_by="tasks/finetune_utils.py")
    pretrained_checkpoint: Optional[str] = setting("--pretrained-checkpoint",
        help="Pretrained checkpoint for finetuning.", read_by="tasks/finetune_utils.py")
    keep_last: bool = setting("--keep-last", default=False,
        help="Keep the last batch (maybe incomplete) in the loader.", read_by="tasks/finetune_utils.py")
    train_data: Optional[List[str]] = setting("--train-data", nargs="+", help="Training data files (finetuning tasks).",
        read_by="tasks/finetune_utils.py")
    valid_data: Optional[List[str]] = setting("--valid-data", nargs="*", help="Validation data file(s).",
        read_by="tasks/zeroshot_gpt/evaluate.py")
    overlapping_eval: int = setting("--overlapping-eval", default=32,
        help="Sliding-window stride for WIKITEXT103: only the last N tokens of each window are scored.",
        read_by="tasks/zeroshot_gpt/evaluate.py")
    strict_lambada: bool = setting("--strict-lambada", default=False,
        help="LAMBADA: tokenize the last word on its own and require all its tokens to be predicted.",
        read_by="tasks/zeroshot_gpt/evaluate.py")


@dataclasses.dataclass
class EvalHarnessSettings:
    """--help group "evaluation harness"."""

    TITLE: ClassVar[str] = "evaluation harness"
    task_list: Optional[str] = setting("--task_list", required=True,
        help="Comma-separated lm-eval task or group names.", read_by="tasks/eval_harness/evaluate.py")
    results_path: str = setting("--results_path", default="./results.json",
        help="Where rank 0 writes the results JSON.", read_by="tasks/eval_harness/evaluate.py")
    include_path: Optional[str] = setting("--include_path",
        help="Folder of extra lm-eval task YAMLs (e.g. tasks/eval_harness/local_tasks for offline use).",
        read_by="tasks/eval_harness/evaluate.py")
    num_fewshot: Optional[int] = setting("--num_fewshot", help="Few-shot examples per prompt (default: the task's).",
        read_by="tasks/eval_harness/evaluate.py")
    limit: Optional[float] = setting("--limit", type=_limit,
        help="Only the first N documents of each task (a fraction < 1: that share of them).",
        read_by="tasks/eval_harness/evaluate.py")
    bootstrap_iters: int = setting("--bootstrap_iters", default=100000,
        help="Bootstrap resamples for the standard errors (0: none).", read_by="tasks/eval_harness/evaluate.py")
    adaptive_seq_len: bool = setting("--adaptive_seq_len", default=False,
        help="Pad each batch to its longest request instead of to --seq-length (faster, same numbers).",
        read_by="tasks/eval_harness/evaluate.py")
    eval_fp32: bool = setting("--eval_fp32", default=False,
        help="Evaluate in fp32 even when the flags say --fp16/--bf16 (the weights are upcast on load).",
        read_by="tasks/eval_harness/evaluate.py")
    intermed_results: bool = setting("--intermed_results", default=False,
        help="Evaluate the tasks one by one, printing and writing the results after each.",
        read_by="tasks/eval_harness/evaluate.py")
    micro_bs_multiplier: int = setting("--micro_bs_multiplier", default=1,
        help="Requests per forward pass = --micro-batch-size x this.", read_by="tasks/eval_harness/evaluate.py")
    max_gen_toks: int = setting("--max_gen_toks", default=256,
        help="Default most new tokens of generate_until requests that do not set max_gen_toks.",
        read_by="tasks/eval_harness/evaluate.py")
