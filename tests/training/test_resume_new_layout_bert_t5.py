"""Resume BERT and T5 training on another layout (issue 15 section 2): the tiny BERT of tests/training/_bert.py (and
the tiny T5 of test_t5_training.py) trained at TP2 x DP1 with the regular optimizer saves iteration 6;
tools/checkpoint/convert.py --model-type BERT (T5) converts it with its optimizer state to TP1, and pretrain_bert
(pretrain_t5) --load at DP2 with the distributed optimizer continues the run: the losses of iterations 7-12 (BERT: lm
and sop) and the validation at 12 within 1e-5 relative, the same consumed samples and learning rates per iteration
(fp32, gloo CPU; vocabularies padded to the same rows at TP 1 and 2: 1,024 for BERT, 1,152 for T5). And through
`--ckpt-format torch_dist` (issue 26): both trained at TP1 x DP2 with the distributed optimizer save iteration 6 as
one torch_dist folder (Megatron Core names, the optimizer state in its fully_reshardable layout) and resume from it
at TP2 with the regular optimizer, continuing the run likewise (one 2-process launch for the four runs).
"""
from __future__ import annotations

import math
import os
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


def _run(argv: list[str], family: str = "BERT") -> tuple[dict, str]:
    """(curve, stdout of both ranks) of a two-process pretrain_bert (pretrain_t5) run."""
    from tests.training import test_t5_training as t5

    runner, curve = (run_many, curve_of) if family == "BERT" else (t5.run_many, t5.curve_of)
    results = run_distributed(runner, 2, args=([(argv, None)],))
    stdout = "".join(r[0]["stdout"] for r in results)
    return curve(results[-1][0], " ".join(argv[-8:])), stdout


def _at6(ckpt: Path, tmp_path: Path) -> Path:
    """A --load folder holding only iteration 6 of `ckpt` (the checkpoint as it stood after iteration 6)."""
    src = tmp_path / f"{ckpt.name}_at6"
    src.mkdir()
    (src / "iter_0000006").symlink_to(ckpt / "iter_0000006")
    (src / "latest_checkpointed_iteration.txt").write_text("6")
    return src


def _assert_steps(resumed: str, original: str) -> None:
    sa, sb = _steps(original), _steps(resumed)
    assert sorted(sb) == list(range(7, ITERS + 1)) and all(sb[it] == sa[it] for it in sb), \
        "consumed samples / learning rate differ"
    assert sb[7][0] == 8 * 7  # consumed samples carried over (6 iterations x global batch 8 before iteration 7)


def _steps(stdout: str) -> dict:
    return {int(m.group(1)): (int(m.group(2)), m.group(3)) for m in STEP_RE.finditer(stdout)}


def test_bert_resume_tp2_regular_to_tp1_dp2_distributed(bert_data: dict, tmp_path: Path) -> None:
    from megatron.checkpoint.conversion.driver import main

    ckpt = tmp_path / "a"
    a, a_out = _run(bert_argv(bert_data, "--tensor-model-parallel-size", "2", "--save", str(ckpt),
                              "--save-interval", "6", iters=ITERS))
    assert sorted(a["train"]) == list(range(1, ITERS + 1))
    src = _at6(ckpt, tmp_path)
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
    _assert_steps(b_out, a_out)


def test_t5_resume_tp2_regular_to_tp1_dp2_distributed(bert_data: dict, tmp_path: Path) -> None:
    from megatron.checkpoint.conversion.driver import main
    from tests.training.test_t5_training import t5_argv

    ckpt = tmp_path / "t5"
    a, a_out = _run(t5_argv(bert_data, "--tensor-model-parallel-size", "2", "--save", str(ckpt),
                            "--save-interval", "6", iters=ITERS), "T5")
    assert sorted(a["train"]) == list(range(1, ITERS + 1))
    summary = main(["--model-type", "T5", "--loader", "megatron", "--saver", "megatron", "--load-dir",
                    str(_at6(ckpt, tmp_path)), "--save-dir", str(tmp_path / "tp1"), "--target-tensor-parallel-size",
                    "1"])
    assert summary["meta"].extra["optimizer"]["step"] == 6

    b, b_out = _run(t5_argv(bert_data, "--use-distributed-optimizer", "--load", str(tmp_path / "tp1"),
                            "--no-load-rng", iters=ITERS), "T5")
    assert sorted(b["train"]) == list(range(7, ITERS + 1))
    for it in range(7, ITERS + 1):
        assert math.isclose(b["train"][it], a["train"][it], rel_tol=REL), \
            f"iteration {it}: {b['train'][it]} vs the original {a['train'][it]}"
    ref_val = dict(a["val"])
    assert b["val"] and all(math.isclose(v, ref_val[p], rel_tol=REL) for p, v in b["val"]), (b["val"], a["val"])
    _assert_steps(b_out, a_out)


def _bert_t5_runs(rank: int, world_size: int, runs: list) -> list[dict]:
    """pretrain_bert / pretrain_t5 runs ("BERT" or "T5", argv, resume_from) one after another in one process group."""
    from tests.training import test_t5_training as t5
    from tests.training._bert import run_bert

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return [(run_bert if family == "BERT" else t5.run_t5)(rank, world_size, argv, resume)
            for family, argv, resume in runs]


@pytest.mark.slow
def test_bert_and_t5_torch_dist_optimizer_state_resumes_at_tp2(bert_data: dict, tmp_path: Path) -> None:
    from megatron.checkpoint.conversion.torch_dist import read_common, read_dcp_metadata
    from tests.training import test_t5_training as t5
    from tests.training.test_t5_training import t5_argv

    save = ["--use-distributed-optimizer", "--ckpt-format", "torch_dist", "--save-interval", "6"]
    resume = ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist"]
    runs = []
    for family, argv in (("BERT", bert_argv), ("T5", t5_argv)):
        ckpt = str(tmp_path / family)
        runs += [(family, argv(bert_data, *save, "--save", ckpt, iters=ITERS), None),
                 (family, argv(bert_data, *resume, "--load", ckpt, iters=ITERS), (ckpt, 6))]
    results = run_distributed(_bert_t5_runs, 2, args=(runs,))[-1]
    for family, (a, b), curve, key, layers in (  # the presets: BERT 2 layers, T5 2 encoder and 1 decoder layer
            ("BERT", results[:2], curve_of, "encoder.layers.self_attention.linear_qkv.weight", 2),
            ("T5", results[2:], t5.curve_of, "decoder.layers.cross_attention.linear_kv.weight", 1)):
        folder = str(tmp_path / family / "iter_0000006")
        names = read_dcp_metadata(folder).state_dict_metadata
        for state in ("param", "exp_avg", "exp_avg_sq"):  # Megatron Core's names, layers stacked
            assert names[f"optimizer.state.{state}.{key}"].size[0] == layers, (family, state)
        common = read_common(folder)
        assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable", family
        assert {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]} == {6.0}, family
        ca, cb = curve(a, f"{family} TP1 x DP2"), curve(b, f"{family} resumed at TP2")
        assert sorted(cb["train"]) == list(range(7, ITERS + 1)), family
        for it in range(7, ITERS + 1):
            pairs = zip(cb["train"][it], ca["train"][it]) if family == "BERT" else [(cb["train"][it], ca["train"][it])]
            assert all(math.isclose(x, y, rel_tol=REL) for x, y in pairs), (family, it, cb["train"][it],
                                                                             ca["train"][it])
        ref_val = {p: v for p, *v in ca["val"]}
        assert cb["val"] and all(p in ref_val for p, *_ in cb["val"]), family
        for p, *v in cb["val"]:
            assert all(math.isclose(x, y, rel_tol=REL) for x, y in zip(v, ref_val[p])), (family, p, v, ref_val[p])
        _assert_steps(b["stdout"], a["stdout"])
