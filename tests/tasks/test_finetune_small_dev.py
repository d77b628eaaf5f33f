"""Finetuning with data-parallel ranks that get few or no validation examples (3 dev examples at DP 2 with
micro-batch 2, a 1-example dev set): every rank takes part in the same collectives, the --eval-interval loss
equals the serial loss over Megatron's padded DistributedSampler order, and the accuracy counts equal the serial
run's (every example counted once).
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
            "dev1": _subset(src / "dev_matched.tsv", out / "dev1.tsv", [3]),
            # what the padded sampler gives 2 ranks from dev3: rank 0 [0, 2], rank 1 [1, 0]
            "dev3-padded": _subset(src / "dev_matched.tsv", out / "dev3padded.tsv", [0, 1, 2, 0]),
            "vocab": str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt")}


def _argv(files: dict, valid: list[str], mbs: int, *extra: str) -> list[str]:
    return ["--task", "MNLI", "--train-data", files["train4"], "--valid-data", *valid, "--epochs", "1",
            *task_argv(files["vocab"], "--micro-batch-size", str(mbs), "--eval-interval", "1", *extra)]


def test_ranks_without_validation_examples_match_serial(files: dict) -> None:
    serial = [dict(entry="tasks", argv=_argv(files, [files["dev3"], files["dev1"]], 4), serial_init=True),
              dict(entry="tasks", argv=_argv(files, [files["dev3-padded"]], 4), serial_init=True)]
    acc_ref, loss_ref = (ok(r, "serial")["result"] for r in run_distributed(run_many, 1, args=(serial,))[0])
    dp2 = [dict(entry="tasks", argv=_argv(files, [files["dev3"]], 2), serial_init=True),
           dict(entry="tasks", argv=_argv(files, [files["dev1"], files["dev3"]], 2, "--eval-interval", "1000"),
                serial_init=True)]
    per_rank = run_distributed(run_many, 2, args=(dp2,))
    for rank, (dev3_run, dev1_run) in enumerate(per_rank):
        ok(dev3_run, f"rank {rank} dev3")
        ok(dev1_run, f"rank {rank} dev1+dev3")
        for got in (dev3_run["result"], dev1_run["result"]):  # the same step: the 4 training examples
            assert math.isclose(got["train_losses"][1]["lm loss"], acc_ref["train_losses"][1]["lm loss"],
                                rel_tol=1e-5)
        assert dev3_run["result"]["accuracy"][0] == {"dev3": acc_ref["accuracy"][0]["dev3"]}
        assert dev1_run["result"]["accuracy"][0] == acc_ref["accuracy"][0]  # rank 1 holds no dev1 example
        assert acc_ref["accuracy"][0]["dev1"][1] == 1 and acc_ref["accuracy"][0]["dev3"][1] == 3
    want = loss_ref["valid_losses"][1]["lm loss"]
    got = per_rank[0][0]["result"]["valid_losses"][1]["lm loss"]
    assert math.isclose(got, want, rel_tol=1e-5), (got, want)
