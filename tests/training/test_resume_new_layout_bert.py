"""Resume BERT training on another layout (issue 15 section 2): the tiny BERT of tests/training/_bert.py trained at
TP2 x DP1 with the regular optimizer saves iteration 6; tools/checkpoint/convert.py --model-type BERT converts it with
its optimizer state to TP1, and pretrain_bert --load at DP2 with the distributed optimizer continues the run: lm and
sop losses of iterations 7-12 and the validation at 12 within 1e-5 relative, the same consumed samples and learning
rates per iteration (fp32, gloo CPU; 1,000-entry vocabulary padded to 1,024 rows at TP 1 and 2).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.training._bert import REL, bert_argv, curve_of, run_many, session_bert_data

ITERS = 12
STEP_RE = re.compile(r" iteration +(\d+)/ *\d+ \| consumed samples: +(\d+) \|.*? learning rate: ([0-9.E+-]+) \|")


@pytest.fixture(scope="module")
def bert_data(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return session_bert_data(shared_data, tmp_path_factory)


def _run(argv: list[str]) -> tuple[dict, str]:
    """(curve, stdout of both ranks) of a two-process pretrain_bert run."""
    results = run_distributed(run_many, 2, args=([(argv, None)],))
    stdout = "".join(r[0]["stdout"] for r in results)
    return curve_of(results[-1][0], " ".join(argv[-8:])), stdout


def _steps(stdout: str) -> dict:
    return {int(m.group(1)): (int(m.group(2)), m.group(3)) for m in STEP_RE.finditer(stdout)}


def test_bert_resume_tp2_regular_to_tp1_dp2_distributed(bert_data: dict, tmp_path: Path) -> None:
    from megatron.checkpoint_conversion.driver import main

    ckpt = tmp_path / "a"
    a, a_out = _run(bert_argv(bert_data, "--tensor-model-parallel-size", "2", "--save", str(ckpt),
                              "--save-interval", "6", iters=ITERS))
    assert sorted(a["train"]) == list(range(1, ITERS + 1))
    src = tmp_path / "a_at6"  # the checkpoint as it stood after iteration 6
    src.mkdir()
    (src / "iter_0000006").symlink_to(ckpt / "iter_0000006")
    (src / "latest_checkpointed_iteration.txt").write_text("6")
    summary = main(["--model-type", "BERT", "--loader", "megatron", "--saver", "megatron", "--load-dir", str(src),
                    "--save-dir", str(tmp_path / "tp1"), "--target-tensor-parallel-size", "1"])
    assert summary["meta"].extra["optimizer"]["step"] == 6

    b, b_out = _run(bert_argv(bert_data, "--use-distributed-optimizer", "--load", str(tmp_path / "tp1"),
                              "--no-load-rng", iters=ITERS))
    assert sorted(b["train"]) == list(range(7, ITERS + 1))
    for it in range(7, ITERS + 1):
        for x, y, name in zip(b["train"][it], a["train"][it], ("lm", "sop")):
            assert math.isclose(x, y, rel_tol=REL), f"iteration {it} {name} loss: {x} vs the original {y}"
    ref_val = {p: v for p, *v in a["val"]}
    assert b["val"] and all(p in ref_val for p, *_ in b["val"])
    for p, *v in b["val"]:
        assert all(math.isclose(x, y, rel_tol=REL) for x, y in zip(v, ref_val[p])), (p, v, ref_val[p])
    sa, sb = _steps(a_out), _steps(b_out)
    assert sorted(sb) == list(range(7, ITERS + 1)) and all(sb[it] == sa[it] for it in sb), \
        "consumed samples / learning rate differ"
    assert sb[7][0] == 8 * 7  # consumed samples carried over (6 iterations x global batch 8 before iteration 7)
