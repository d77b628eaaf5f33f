"""MNLI and QQP finetuning (Megatron's tasks/glue/finetune.py): the Classification model, the datasets, and the
GLUE submission files (``index<TAB>prediction`` with label names)."""
from __future__ import annotations

import argparse
import os
from typing import Any

from megatron import global_vars
from megatron.checkpoint.atomic_io import atomic_write_text
from megatron.core import parallel_state as ps
from megatron.core.transformer_config import TransformerConfig
from megatron.models.bert.classification import Classification
from megatron.utils import print_rank_0
from tasks.finetune_utils import FinetuneTask
from tasks.glue import mnli, qqp

_TASKS = {"MNLI": (mnli, ["contradiction", "entailment", "neutral"]), "QQP": (qqp, ["0", "1"])}


def glue_task(name: str, args: argparse.Namespace) -> FinetuneTask:
    module, label_names = _TASKS[name]

    def build(paths: list[str]) -> Any:
        return module.build_dataset(paths, global_vars.get_tokenizer(), args.seq_length)

    def model_provider(config: TransformerConfig, pre_process: bool = True,
                       post_process: bool = True) -> Classification:
        state = ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()
        print_rank_0(f" > building classification model for {name} ({module.NUM_CLASSES} classes) ...")
        return Classification(config, module.NUM_CLASSES, pp_state=state,
                              num_tokentypes=2, pre_process=pre_process, post_process=post_process)

    def write(out_dir: str, dataset: Any, preds: list) -> str:
        path = os.path.join(out_dir, f"predictions_{name}_{dataset.dataset_name}.tsv")
        lines = ["index\tprediction"] + [f"{uid}\t{label_names[p]}" for uid, p in preds]
        atomic_write_text(path, "\n".join(lines) + "\n")
        return path

    return FinetuneTask(name, build, model_provider, write)
