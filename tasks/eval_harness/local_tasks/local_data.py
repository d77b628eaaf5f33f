"""Offline data loading for the shipped lm-eval tasks: JSON Lines next to the YAML, never the Hugging Face hub.

The task YAMLs name `custom_dataset: !function local_data.load_jsonl` with `dataset_kwargs: {data_file: ...}`;
lm-eval calls `load_jsonl(**metadata, **dataset_kwargs)`. A relative `data_file` is resolved against this folder
(so the tasks work from any working directory); an absolute one is used as is.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def load_jsonl(data_file: str, split: str = "test", **_metadata: Any) -> Any:
    """DatasetDict {split: rows of `data_file`} (one JSON object per line)."""
    import datasets

    path = data_file if os.path.isabs(data_file) else os.path.join(HERE, data_file)
    if not os.path.exists(path):
        raise FileNotFoundError(f"local lm-eval task data {path} does not exist; fix data_file in the task YAML")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})


def wikitext_page(doc: dict) -> str:
    """A WikiText page as running text (the zero-shot WIKITEXT103 task's detokenizer)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from tasks.zeroshot_gpt.detokenizer import wikitext_detokenizer

    return wikitext_detokenizer(doc["page"])
