"""Training that cannot mean anything stops with one line naming the flag and exit code 1: an empty data file, a
--split that gives training 0% with --train-iters > 0, --train-iters 0, and data whose token ids exceed the vocabulary
(caught when the data is opened, from the .bin's largest id, not at step 1)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.reliability.helpers import assert_one_line_error, run, train_argv


def _write(prefix: Path, docs: list[list[int]], vocab_size: int) -> str:
    from megatron.data.indexed_dataset import index_file_path, make_builder

    builder = make_builder(str(prefix) + ".bin", impl="mmap", vocab_size=vocab_size)
    for doc in docs:
        builder.add_item(np.asarray(doc, dtype=np.int64))
        builder.end_document()
    builder.finalize(index_file_path(str(prefix)))
    return str(prefix)


def _argv(data: dict, prefix: str, *extra: str, iters: int = 2) -> list[str]:
    argv = train_argv(data, *extra, iters=iters)
    argv[argv.index("--data-path") + 1] = prefix
    return argv


@pytest.mark.parametrize("case", ["empty", "split", "iters0", "vocab"])
def test_bad_training_input_is_one_line(tiny_data: dict, tmp_path: Path, case: str) -> None:
    prefix = tiny_data["prefix"]
    extra: list[str] = []
    iters = 2
    if case == "empty":
        prefix = _write(tmp_path / "empty_text_document", [], 5000)
        expected = [f"--data-path {prefix}: the data set is empty"]
    elif case == "split":
        extra = ["--split", "0,100,0"]
        expected = ["--split 0,100,0 gives the training split 0%", "--train-iters 2", "--skip-train"]
    elif case == "iters0":
        iters = 0
        expected = ["--train-iters must be > 0 (got 0)"]
    else:  # ids of a 70k-entry tokenizer in a uint32 file, model vocabulary 5,120
        prefix = _write(tmp_path / "big_text_document", [list(range(200)) + [60000]] * 20, 70000)
        expected = [f"--data-path {prefix} holds token id 60000", "5120 entries"]
    argv = _argv(tiny_data, prefix, *extra, iters=iters)
    if case == "split":
        argv[argv.index("--split") + 1] = "0,100,0"
    proc = run("pretrain_gpt.py", *argv, cwd=tmp_path)
    assert_one_line_error(proc, *expected)
    assert "training ..." not in proc.stdout  # caught before the first step


def test_max_token_id_is_cached(tmp_path: Path) -> None:
    from megatron.data.data_checks import max_token_id

    prefix = _write(tmp_path / "d", [[1, 2, 70000], [5]], 100000)
    assert max_token_id(prefix) == 70000
    assert (tmp_path / "d.maxid.json").is_file()
    assert max_token_id(prefix) == 70000
    assert max_token_id(_write(tmp_path / "e", [], 100000)) is None


@pytest.mark.parametrize("case", ["moe_nan", "moe_topk1", "save_file", "load_file"])
def test_bad_flags_stop_pretrain_at_start_up(tiny_data: dict, tmp_path: Path, case: str) -> None:
    """The start-up refusals of tests/test_start_up_refusals.py from the entry point: exit code 1, stderr's last line
    the one-line error, and nothing trained or saved."""
    (tmp_path / "a_file").write_text("not a folder")
    extra = {"moe_nan": ["--num-experts", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "nan"],
             "moe_topk1": ["--num-experts", "2", "--disable-bias-linear", "--moe-router-topk", "1"],
             "save_file": ["--save", "a_file", "--save-interval", "1"],
             "load_file": ["--load", "a_file"]}[case]
    expected = {"moe_nan": "error: --moe-aux-loss-coeff must be a finite number >= 0 (got nan)",
                "moe_topk1": "error: --moe-router-topk 1 needs --moe-router-pre-softmax (softmax over one logit is 1), "
                             "as in Megatron-LM",
                "save_file": "error: --save a_file is a file, not a folder; point --save at a folder you can write to",
                "load_file": "error: --load a_file is a file, not a checkpoint folder; point --load at the folder "
                             "--save wrote (the one holding latest_checkpointed_iteration.txt)"}[case]
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, *extra), cwd=tmp_path)
    assert_one_line_error(proc, expected[len("error: "):])
    assert proc.stderr.strip().splitlines()[-1] == expected
    assert "iteration        1/" not in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
