"""Finetuning with data-parallel ranks that get few or no validation examples (3 dev examples at DP 4, and at
TP 2 x DP 2 with micro-batch 2, where DP rank 1 used to have no loss batch and left rank 0 hanging): every rank takes
part in the same collectives, the --eval-interval loss equals the serial loss over Megatron's padded
DistributedSampler order, and the accuracy counts equal the serial run's (every example counted once).
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.tasks._finetune import ok, run_many, task_argv


def _subset(src: Path, out: Path, rows: list[int]) -> str:
    lines = src.read_text(encoding="utf-8").splitlines()
    out.write_text("\n".join([lines[0], *(lines[1 + r] for r in rows)]) + "\n", encoding="utf-8")
    return str(out)


@pytest.fixture(scope="module")
def files(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    src = shared_data / "mnli-sample"
    out = tmp_path_factory.mktemp("small_dev") / "MNLI"
    out.mkdir()
    shutil.copy(src / "dev_matched.tsv", out / "dev_matched.tsv")
    return {"train4": _subset(src / "train.tsv", out / "train4.tsv", [0, 1, 2, 3]),
            "dev3": _subset(src / "dev_matched.tsv", out / "dev3.tsv", [0, 1, 2]),
            # what the padded sampler gives 2 ranks from dev3: rank 0 [0, 2], rank 1 [1, 0]
            "dev3-padded": _subset(src / "dev_matched.tsv", out / "dev3padded.tsv", [0, 1, 2, 0]),
            "vocab": str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt")}


def _argv(files: dict, valid: list[str], mbs: int, *extra: str) -> list[str]:
    return ["--task", "MNLI", "--train-data", files["train4"], "--valid-data", *valid, "--epochs", "1",
            *task_argv(files["vocab"], "--micro-batch-size", str(mbs), "--eval-interval", "1", *extra)]


def test_ranks_without_validation_examples_match_serial(files: dict) -> None:
    serial = [dict(entry="tasks", argv=_argv(files, [files["dev3"]], 4), serial_init=True),
              dict(entry="tasks", argv=_argv(files, [files["dev3-padded"]], 4), serial_init=True)]
    ref, padded_ref = (ok(r, "serial")["result"] for r in run_distributed(run_many, 1, args=(serial,))[0])
    assert ref["valid_losses"] == {} and ref["accuracy"][0]["dev3"][1] == 3  # 3 examples < one serial batch of 4
    layouts = {"dp4": (1, []),  # DP rank 3 holds no dev3 example
               "tp2-dp2": (2, ["--tensor-model-parallel-size", "2"])}  # dev3 [0, 2] and [1]
    runs = [dict(entry="tasks", argv=_argv(files, [files["dev3"]], mbs, *extra), serial_init=True)
            for mbs, extra in layouts.values()]
    per_rank = run_distributed(run_many, 4, args=(runs,))
    for rank, results in enumerate(per_rank):
        for name, res in zip(layouts, results):
            got = ok(res, f"{name} rank {rank}")["result"]
            # the same step (the 4 training examples), every dev example counted once, and the --eval-interval
            # loss over the padded sampler's [0, 1, 2, 0]
            assert math.isclose(got["train_losses"][1]["lm loss"], ref["train_losses"][1]["lm loss"], rel_tol=1e-5)
            assert got["accuracy"] == ref["accuracy"], (name, rank)
            assert math.isclose(got["valid_losses"][1]["lm loss"], padded_ref["valid_losses"][1]["lm loss"],
                                rel_tol=1e-5), (name, rank, got["valid_losses"], padded_ref["valid_losses"])
