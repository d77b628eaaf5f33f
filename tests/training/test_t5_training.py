"""pretrain_t5.py end to end on a tiny T5 (the BERT tests' sentence-level WordPiece data + 100 sentinels,
vocabulary padded to 1,152 at TP 1 and 2 so that the curves can be equal; 2 encoder and 1 decoder layers, hidden
64, enc 64 / dec 32 tokens, fp32, no dropout): the serial run learns and logs Megatron's `lm loss`; TP=2 + SP,
DP=2 + distributed optimizer, DeepSpeed ZeRO-2 and ZeRO-3, DP=2 with torch DDP and full recompute train the serial
curve (losses and validation 1e-5 relative, grad norms 2e-3); resuming DP=2 + distributed optimizer at iteration 6
reproduces iterations 7..12 exactly; bf16 and fp16 (loss scaling) stay within 1% of fp32; a pipeline without
--pipeline-model-parallel-split-rank, a pipeline under DeepSpeed and a missing --decoder-seq-length are refused with
one line (pipelines with a split rank: test_t5_pipeline.py).
"""
from __future__ import annotations

import contextlib
import io
import math
import os
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from megatron.presets import get_preset
from tests.dist_utils import run_distributed
from tests.ds._workers import write_ds_config
from tests.log_lines import iteration_values, validation_values
from tests.training._bert import session_bert_data

ITERS = 20
REL = 1e-5


def t5_argv(data: dict, *extra: str, iters: int = ITERS) -> list[str]:
    return [
        *get_preset("t5_test").argv(),
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
        "--lr", "2e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--no-bias-gelu-fusion", "--vocab-file", data["vocab"], "--vocab-extra-ids", "100",
        "--make-vocab-size-divisible-by", "64", "--data-path", data["prefix"], "--split", "90,10,0", "--log-interval", "1", "--eval-interval", "6",
        "--eval-iters", "2", "--num-workers", "0", "--seed", "1234", *extra,
    ]


def parse_curve(text: str) -> dict:
    lm, norms = iteration_values(text), iteration_values(text, "grad norm")
    train = {it: loss for it, loss in lm.items() if it in norms}
    return {"train": train, "grad_norm": {it: norms[it] for it in train}, "val": validation_values(text)}


def run_t5(rank: int, world_size: int, argv: list[str], resume_from: Optional[tuple[str, int]] = None,
           model_provider: Optional[Callable] = None) -> dict:
    """pretrain_t5.py's pretrain() in this process (tests/harness.py; optionally with another `model_provider`),
    stdout captured; user errors come back as text."""
    from megatron.errors import MegatronUserError
    from tests.ds._workers import _reset_megatron, ds_env
    from tests.harness import pretrain_run

    ds_env(rank, world_size)
    if resume_from is not None:
        if rank == 0:
            Path(resume_from[0], "latest_checkpointed_iteration.txt").write_text(str(resume_from[1]))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    buf, error, result = io.StringIO(), None, None
    with contextlib.redirect_stdout(buf):
        try:
            result = pretrain_run(argv, "pretrain_t5", model_provider=model_provider)
        except (MegatronUserError, RuntimeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            _reset_megatron()
    return {"stdout": buf.getvalue(), "result": result, "error": error}


def run_many(rank: int, world_size: int, runs: list) -> list[dict]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return [run_t5(rank, world_size, argv, resume) for argv, resume in runs]


def curve_of(result: dict, what: str) -> dict:
    assert result["error"] is None, f"{what}: {result['error']}"
    return parse_curve(result["stdout"])


def assert_matches(curve: dict, ref: dict, what: str) -> None:
    assert sorted(curve["train"]) == list(range(1, ITERS + 1)), f"{what}: iterations {sorted(curve['train'])}"
    for it, ref_loss in ref["train"].items():
        assert math.isclose(curve["train"][it], ref_loss, rel_tol=REL), (what, it, curve["train"][it], ref_loss)
        assert math.isclose(curve["grad_norm"][it], ref["grad_norm"][it], rel_tol=2e-3, abs_tol=2e-3), (what, it)
    assert [v[0] for v in curve["val"]] == [v[0] for v in ref["val"]], f"{what}: validation points differ"
    for a, b in zip(curve["val"], ref["val"]):
        assert math.isclose(a[1], b[1], rel_tol=REL), (what, a, b)


@pytest.fixture(scope="module")
def t5_data(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return session_bert_data(shared_data, tmp_path_factory)


@pytest.fixture(scope="module")
def serial(t5_data: dict) -> dict:
    ((res,),) = run_distributed(run_many, 1, args=([(t5_argv(t5_data), None)],))
    curve = curve_of(res, "serial")
    assert sorted(curve["train"]) == list(range(1, ITERS + 1)), res["stdout"][-3000:]
    assert [v[0] for v in curve["val"]] == [*(f"iteration {i}" for i in range(6, ITERS + 1, 6)),
                                        "the end of training for val data"]
    lm = [curve["train"][it] for it in range(1, ITERS + 1)]
    assert sum(lm[-3:]) / 3 < sum(lm[:3]) / 3 - 0.3, f"the tiny T5's lm loss should go down: {lm}"
    assert "building T5 model" in res["stdout"]
    return curve


def test_two_process_layouts_match_serial_and_resume_exactly(serial: dict, t5_data: dict, tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    zero2 = write_ds_config(str(tmp_path / "zero2.json"), zero_optimization={"stage": 2},
                            train_micro_batch_size_per_gpu=2, train_batch_size=8)
    distopt = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000"]
    layouts = {
        "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "dp2-distopt": [*distopt, "--save", str(save), "--save-interval", str(ITERS // 2)],
        "zero2-dp2": ["--deepspeed", "--deepspeed_config", zero2],
    }
    runs = [(t5_argv(t5_data, *extra), None) for extra in layouts.values()]
    runs.append((t5_argv(t5_data, *distopt, "--load", str(save)), (str(save), ITERS // 2)))
    results = run_distributed(run_many, 2, args=(runs,))
    last = results[-1]
    for i, name in enumerate(layouts):
        assert_matches(curve_of(last[i], name), serial, name)
    full, again = curve_of(last[1], "dp2-distopt"), curve_of(last[3], "dp2-distopt resumed")
    assert sorted(again["train"]) == list(range(ITERS // 2 + 1, ITERS + 1))
    for it in again["train"]:  # identical to the last printed digit
        assert again["train"][it] == full["train"][it], (it, full["train"][it], again["train"][it])
        assert again["grad_norm"][it] == full["grad_norm"][it]
    assert again["val"] == full["val"][1:]


def test_zero3_and_torch_ddp_with_full_recompute_match_serial(serial: dict, t5_data: dict, tmp_path: Path) -> None:
    zero3 = write_ds_config(str(tmp_path / "zero3.json"), zero_optimization={"stage": 3},
                            train_micro_batch_size_per_gpu=2, train_batch_size=8)
    layouts = {
        "zero3-dp2": ["--deepspeed", "--deepspeed_config", zero3],
        "dp2-torch-ddp-full-recompute": ["--DDP-impl", "torch", "--recompute-granularity", "full",
                                         "--recompute-method", "uniform"],
    }
    results = run_distributed(run_many, 2, args=([(t5_argv(t5_data, *extra), None) for extra in layouts.values()],))
    for i, name in enumerate(layouts):
        assert_matches(curve_of(results[-1][i], name), serial, name)


def test_bf16_and_fp16_stay_within_one_percent_of_fp32(serial: dict, t5_data: dict) -> None:
    runs = [(t5_argv(t5_data, "--bf16"), None), (t5_argv(t5_data, "--fp16", "--initial-loss-scale", "1024"), None)]
    ((bf16, fp16),) = run_distributed(run_many, 1, args=(runs,))
    for res, name in ((bf16, "bf16"), (fp16, "fp16")):
        curve = curve_of(res, name)
        assert sorted(curve["train"]) == list(range(1, ITERS + 1)), name
        for it, ref in serial["train"].items():
            assert math.isclose(curve["train"][it], ref, rel_tol=1e-2), (name, it, curve["train"][it], ref)
    assert "loss scale: 1024.0" in fp16["stdout"]


def test_refusals_are_one_line(t5_data: dict, tmp_path: Path) -> None:
    ds = write_ds_config(str(tmp_path / "ds.json"), zero_optimization={"stage": 1}, train_micro_batch_size_per_gpu=2,
                         train_batch_size=8)
    cases = {  # pipelines with a split rank: tests/training/test_t5_pipeline.py
        "needs --pipeline-model-parallel-split-rank": ["--pipeline-model-parallel-size", "2"],
        "T5 pipeline parallelism runs without DeepSpeed": ["--pipeline-model-parallel-size", "2",
                                                           "--pipeline-model-parallel-split-rank", "1",
                                                           "--deepspeed", "--deepspeed_config", ds],
    }
    runs = [(t5_argv(t5_data, *extra, iters=3), None) for extra in cases.values()]
    results = run_distributed(run_many, 2, args=(runs,))
    for res, named in zip(results[0], cases):
        assert res["error"] is not None and named in res["error"] and "\n" not in res["error"], res["error"]
    missing = [a for a in t5_argv(t5_data, iters=3)]
    i = missing.index("--decoder-seq-length")
    del missing[i:i + 2]
    ((res,),) = run_distributed(run_many, 1, args=([(missing, None)],))
    assert res["error"] is not None and "--decoder-seq-length" in res["error"] and "\n" not in res["error"]
