"""RACE finetuning (Megatron's tasks/race/finetune.py): MultipleChoice over 4 options; predictions as JSONL."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from megatron import global_vars
from megatron.checkpoint.atomic_io import atomic_write_text
from megatron.core import parallel_state as ps
from megatron.core.transformer_config import TransformerConfig
from megatron.models.bert.multiple_choice import MultipleChoice
from megatron.utils import print_rank_0
from tasks.finetune_utils import FinetuneTask
from tasks.race.data import build_dataset


def race_task(args: argparse.Namespace) -> FinetuneTask:
    def build(paths: list[str]) -> Any:
        return build_dataset(paths, global_vars.get_tokenizer(), args.seq_length)

    def model_provider(config: TransformerConfig, pre_process: bool = True,
                       post_process: bool = True) -> MultipleChoice:
        state = ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()
        print_rank_0(" > building multichoice model for RACE ...")
        return MultipleChoice(config, pp_state=state, num_tokentypes=2,
                              pre_process=pre_process, post_process=post_process)

    def write(out_dir: str, dataset: Any, preds: list) -> str:
        path = os.path.join(out_dir, f"predictions_RACE_{dataset.dataset_name}.jsonl")
        atomic_write_text(path, "".join(json.dumps({"uid": uid, "answer": "ABCD"[p]}) + "\n" for uid, p in preds))
        return path

    return FinetuneTask("RACE", build, model_provider, write)
