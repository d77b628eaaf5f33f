"""RACE (Megatron's tasks/race/data.py): each path is a directory of ``*.txt`` files (read in sorted order here;
Megatron's unsorted glob makes uids depend on the file system), one JSON object per line with ``article``,
``questions``, ``options`` (4 per question) and ``answers`` (A-D). Each option gives the pair (qa, article): qa is
the question with ``_`` filled by the option, else ``question + ' ' + option``, cleaned and cut to 128 tokens; the
article is the second segment and is truncated first. A sample holds the 4 options as [4, seq_length] arrays.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from tasks.data_utils import (
    RowCounter,
    TaskDataset,
    build_tokens_types_paddings_from_ids,
    clean_text,
    dataset_name,
    sorted_files,
    text_lines,
)

NUM_CHOICES = 4
MAX_QA_LENGTH = 128


def qa_text(question: str, option: str) -> str:
    return question.replace("_", option) if "_" in question else " ".join([question, option])


def read_race_file(path: str, verbose: bool = True) -> list[tuple[str, list[str], int]]:
    """(article, 4 qa texts, label) per question of one file; malformed questions/lines are skipped and counted."""
    out: list[tuple[str, list[str], int]] = []
    counter = RowCounter(path, verbose)
    for lineno, line in text_lines(path):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            article = clean_text(doc["article"])
            questions, options, answers = doc["questions"], doc["options"], doc["answers"]
            if not (len(questions) == len(options) == len(answers)):
                raise ValueError(f"{len(questions)} questions, {len(options)} option lists, "
                                 f"{len(answers)} answers")
        except (ValueError, KeyError, TypeError) as exc:
            counter.skip(lineno, f"not a RACE JSON line ({type(exc).__name__}: {exc})")
            continue
        for q, (question, opts, answer) in enumerate(zip(questions, options, answers)):
            label = ord(str(answer)) - ord("A") if len(str(answer)) == 1 else -1
            if len(opts) != NUM_CHOICES or not 0 <= label < NUM_CHOICES or not article:
                counter.skip(lineno, f"question {q}: needs {NUM_CHOICES} options, an answer A-D and an article")
                continue
            out.append((article, [clean_text(qa_text(question, o)) for o in opts], label))
    counter.finish(len(out))
    return out


def build_dataset(paths: list[str], tokenizer: Any, max_seq_length: int, max_qa_length: int = MAX_QA_LENGTH,
                  verbose: bool = True) -> TaskDataset:
    files = [f for p in paths for f in sorted_files(p, "*.txt")]
    samples = []
    for path in files:
        for article, qas, label in read_race_file(path, verbose):
            article_ids = tokenizer.tokenize(article)
            rows = [build_tokens_types_paddings_from_ids(tokenizer.tokenize(qa)[:max_qa_length], article_ids,
                                                         max_seq_length, tokenizer.cls, tokenizer.sep, tokenizer.pad)
                    for qa in qas]
            samples.append({"text": np.array([r[0] for r in rows], dtype=np.int64),
                            "types": np.array([r[1] for r in rows], dtype=np.int64),
                            "padding_mask": np.array([r[2] for r in rows], dtype=np.int64),
                            "label": label, "uid": len(samples)})
    return TaskDataset(dataset_name(paths[0], "RACE"), samples, sample_multiplier=NUM_CHOICES)
