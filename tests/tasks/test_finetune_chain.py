"""The chain a user follows: pretrain a tiny BERT with pretrain_bert.py (3 steps, saved) -> tasks/main.py --task MNLI
--pretrained-checkpoint (the missing classification head is noticed) -> --epochs 0 --load evaluates the finetuned
checkpoint with the same accuracy; a missing --pretrained-checkpoint is a one-line error; a BERT pretrained with
--bert-no-binary-head finetunes with a fresh pooler and notices. Also RACE (4-way multiple choice over the RACE sample
directories, predictions as JSONL) and QQP through tasks/main.py, and the example scripts.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron.presets import get_preset
from tests.dist_utils import free_port, run_distributed
from tests.interpreter import path_with_this_python
from tests.tasks._finetune import ok, run_many
from tests.tasks.test_finetune import accuracy_lines
from tests.training._bert import bert_argv, session_bert_data


def _model(vocab: str, *extra: str) -> list[str]:  # bert_argv's architecture (hidden 64, seq 64, erf GeLU)
    return [*get_preset("bert_test").argv(), "--vocab-file", vocab, "--micro-batch-size", "2", "--lr", "1e-3",
            "--log-interval", "1", "--distributed-backend", "gloo", "--no-bias-gelu-fusion", "--seed", "1234",
            "--eval-interval", "1000", "--eval-iters", "1", *extra]


@pytest.fixture(scope="module")
def pretrained(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """pretrain_bert.py: 3 steps of the tiny BERT, saved (and the same with --bert-no-binary-head)."""
    bert = session_bert_data(shared_data, tmp_path_factory)
    pre = tmp_path_factory.mktemp("pretrained") / "bert"
    argv = bert_argv(bert, "--save", str(pre), "--save-interval", "3", iters=3)
    nobin = bert_argv(bert, "--bert-no-binary-head", "--eval-iters", "0", "--save", str(pre.parent / "nobin"),
                      "--save-interval", "3", iters=3)
    res, res2 = run_distributed(run_many, 1, args=([dict(entry="pretrain_bert", argv=argv),
                                                    dict(entry="pretrain_bert", argv=nobin)],))[0]
    assert ok(res, "pretrain")["result"]["iteration"] == 3
    assert ok(res2, "pretrain --bert-no-binary-head")["result"]["iteration"] == 3
    return {"dir": pre, "nobin": pre.parent / "nobin", "vocab": bert["vocab"]}


def test_pretrain_finetune_evaluate_chain_race_and_qqp(shared_data: Path, tmp_path: Path, pretrained: dict) -> None:
    vocab, mnli, race = pretrained["vocab"], shared_data / "mnli-sample", shared_data / "race-sample" / "RACE"
    pre, fin, ev, rc = pretrained["dir"], tmp_path / "mnli", tmp_path / "eval", tmp_path / "race"
    qqp = tmp_path / "QQP"
    qqp.mkdir()
    (qqp / "train.tsv").write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n" + "".join(
        f"{i}\t{2 * i}\t{2 * i + 1}\tWhat is the time {i} ?\tWhat time is it {i % 2} ?\t{i % 2}\n" for i in range(4)))
    (qqp / "test.tsv").write_text("id\tquestion1\tquestion2\n0\tWhere is it ?\tWhere was it ?\n")
    runs = [
        dict(entry="tasks", argv=["--task", "MNLI", "--train-data", str(mnli / "train.tsv"), "--valid-data",
                                  str(mnli / "dev_matched.tsv"), "--epochs", "1", "--pretrained-checkpoint", str(pre),
                                  *_model(vocab, "--save", str(fin), "--save-interval", "1000")]),
        dict(entry="tasks", argv=["--task", "MNLI", "--epochs", "0", "--valid-data", str(mnli / "dev_matched.tsv"),
                                  *_model(vocab, "--load", str(fin), "--save", str(ev), "--save-interval", "1")]),
        dict(entry="tasks", argv=["--task", "RACE", "--train-data", str(race / "train" / "middle"),
                                  str(race / "train" / "high"), "--valid-data", str(race / "dev" / "middle"),
                                  str(race / "dev" / "high"), "--epochs", "1", "--pretrained-checkpoint", str(pre),
                                  *_model(vocab, "--save", str(rc), "--save-interval", "1000")]),
        dict(entry="tasks", argv=["--task", "RACE", "--epochs", "0", "--valid-data", str(race / "test" / "high"),
                                  *_model(vocab, "--load", str(rc), "--save", str(rc), "--save-interval", "1")]),
        dict(entry="tasks", argv=["--task", "QQP", "--train-data", str(qqp / "train.tsv"), "--valid-data",
                                  str(qqp / "train.tsv"), "--epochs", "1", *_model(vocab)]),
        dict(entry="tasks", argv=["--task", "QQP", "--valid-data", str(qqp / "train.tsv"), "--epochs", "0",
                                  "--pretrained-checkpoint", str(tmp_path / "nothing"), *_model(vocab)]),
        dict(entry="tasks", argv=["--task", "QQP", "--valid-data", str(qqp / "train.tsv"), "--epochs", "0",
                                  "--load", str(qqp), *_model(vocab)]),
        dict(entry="tasks", argv=["--task", "QQP", "--train-data", str(qqp / "train.tsv"), "--epochs", "1",
                                  "--pretrained-checkpoint", str(pretrained["nobin"]), *_model(vocab)]),
    ]
    *results, missing, no_weights, from_nobin = run_distributed(run_many, 1, args=(runs,))[0]
    ok(from_nobin, "finetune from --bert-no-binary-head")  # Megatron asserts; here a fresh pooler, with notices
    assert "***WARNING*** the checkpoint has no pooler (a BERT pretrained with --bert-no-binary-head)" \
        in from_nobin["stdout"]
    assert "***WARNING*** expected tokentype embeddings in the checkpoint" in from_nobin["stdout"]
    assert sorted(from_nobin["result"]["train_losses"]) == [1, 2]
    assert no_weights["error"] is not None and f"--load {qqp} holds no checkpoint" in no_weights["error"]
    fin_res, ev_res, race_res, race_ev, qqp_res = (
        ok(r, w) for r, w in zip(results, ("finetune", "evaluate", "race", "race eval", "qqp")))
    assert missing["error"] is not None and "\n" not in missing["error"]
    assert f"--pretrained-checkpoint {tmp_path / 'nothing'}: no checkpoint there" in missing["error"]
    assert f"loading checkpoint from {pre} at iteration 3" in fin_res["stdout"]
    assert " > could not find classification_head in the checkpoint, initializing to random (a new head" \
        in fin_res["stdout"]
    assert sorted(fin_res["result"]["train_losses"]) == [1, 2, 3]
    assert accuracy_lines(ev_res["stdout"])[(-1, "dev-matched")] == accuracy_lines(fin_res["stdout"])[
        (0, "dev-matched")]
    assert len((ev / "predictions_MNLI_dev-matched.tsv").read_text().splitlines()) == 6

    # RACE: 12 training questions, micro-batch 2 -> 6 steps of 8 sequences; 2 + 2 dev questions
    assert "could not find multichoice_head" in race_res["stdout"]
    assert sorted(race_res["result"]["train_losses"]) == list(range(1, 7))
    assert " consumed samples:           48 |" in race_res["stdout"]  # sequences, as Megatron counts them
    acc = accuracy_lines(race_res["stdout"])
    assert sorted(acc) == [(0, "dev-high"), (0, "dev-middle")] and all(t == 2 for _, t in acc.values())
    preds = [json.loads(line) for line in (rc / "predictions_RACE_test-high.jsonl").read_text().splitlines()]
    assert [p["uid"] for p in preds] == [0, 1] and {p["answer"] for p in preds} <= set("ABCD")
    assert sorted(accuracy_lines(race_ev["stdout"])) == [(-1, "test-high")]

    assert sorted(qqp_res["result"]["train_losses"]) == [1, 2]
    assert accuracy_lines(qqp_res["stdout"])[(0, "train")][1] == 4


def test_examples_mnli_script_finetunes_with_two_processes(shared_data: Path, tmp_path: Path,
                                                           pretrained: dict) -> None:
    """examples/finetune_mnli_distributed.sh under torchrun (2 CPU processes, DP=2) on the MNLI sample; the RACE and
    QQP scripts' commands (DRY_RUN)."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    env = dict(os.environ, PRESET="tiny", GLUE_DIR=str(tmp_path / "glue"), PRETRAINED_CHECKPOINT=str(pretrained["dir"]),
               VOCAB_FILE=pretrained["vocab"], CHECKPOINT_PATH=str(tmp_path / "out"), EPOCHS="1",
               GPUS_PER_NODE="2", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    env["PATH"] = path_with_this_python(env["PATH"])  # `python` is this interpreter
    (tmp_path / "glue").mkdir()
    shutil.copytree(shared_data / "mnli-sample", tmp_path / "glue" / "MNLI")
    small = ["--hidden-size", "64", "--seq-length", "64", "--max-position-embeddings", "64",
             "--no-bias-gelu-fusion", "--log-interval", "1", "--distributed-backend", "gloo"]
    proc = subprocess.run(["bash", str(examples / "finetune_mnli_distributed.sh"), *small], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = accuracy_lines(proc.stdout)
    assert sorted(acc) == [(0, "dev-matched"), (0, "dev-mismatched")] and all(t == 5 for _, t in acc.values())
    # the script's micro-batch 8 x 2 processes does not fit the 6 examples: it says so and uses micro-batch 3
    assert "note: --train-data has 6 examples, fewer than one batch of 16 (micro-batch 8 x 2 processes): using " \
           "micro-batch 3" in proc.stderr, proc.stderr[-3000:]
    assert " iteration        1/       1 |" in proc.stdout  # 6 examples over 2 ranks of micro-batch 3
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "1"
    for script, task in (("finetune_race_distributed.sh", "RACE"), ("finetune_qqp_distributed.sh", "QQP")):
        dry = subprocess.run(["bash", str(examples / script)], env=dict(env, DRY_RUN="1"), capture_output=True,
                             text=True, timeout=60)
        assert dry.returncode == 0 and f"tasks/main.py --task {task} " in dry.stdout, dry.stderr
