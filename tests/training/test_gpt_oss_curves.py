"""A tiny GPT-OSS-style model (attention sinks, linear biases everywhere, experts with biases and the clamped
quick-GeGLU, router bias; issue #38) trains the serial run's 6-step curve (lm loss and load_balancing_loss within
1e-5 relative) under TP=2 + SP (sinks and expert fc1 biases split over TP, fc2 biases and the router bias
replicated) and under EP=2 (experts and their biases over 2 ranks), both in one 2-process run."""
from __future__ import annotations

import math

import pytest

from tests.dist_utils import run_distributed
from tests.log_lines import iteration_values
from tests.training._llama import run_many
from tests.training._workers import tiny_gpt_argv

ITERS = 6
GPT_OSS = ["--hidden-size", "32", "--seq-length", "32", "--max-position-embeddings", "32", "--ffn-hidden-size", "24",
           "--num-attention-heads", "4", "--kv-channels", "8", "--group-query-attention", "--num-query-groups", "2",
           "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
           "--softmax-type", "learnable", "--quick-geglu", "--glu-linear-offset", "1.0",
           "--activation-func-clamp-value", "7.0", "--num-experts", "4", "--moe-router-topk", "2",
           "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "2", "--eval-interval", "10"]
LAYOUTS = {"tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "ep2": ["--expert-model-parallel-size", "2"]}
pytestmark = pytest.mark.slow


def _curve(result: dict, what: str) -> dict:
    assert result["error"] is None, f"{what}: {result['error']}"
    lm, lbl = (iteration_values(result["stdout"], key) for key in ("lm loss", "load_balancing_loss"))
    return {it: (lm[it], lbl[it]) for it in lm if it in lbl}


def test_gpt_oss_tp2_sp_and_ep2_curves_equal_serial(gpt_data: dict) -> None:
    argv = [tiny_gpt_argv(gpt_data, *GPT_OSS, *extra, iters=ITERS) for extra in ([], *LAYOUTS.values())]
    ((serial_res,),) = run_distributed(run_many, 1, args=([("stage", argv[0])],))
    serial = _curve(serial_res, "serial")
    assert sorted(serial) == list(range(1, ITERS + 1)) and serial[ITERS][0] < serial[1][0]
    results = run_distributed(run_many, 2, args=([("stage", a) for a in argv[1:]],))
    for i, name in enumerate(LAYOUTS):
        curve = _curve(results[-1][i], name)  # the last rank logs
        assert sorted(curve) == sorted(serial), name
        for it in serial:
            for what, a, b in zip(("lm loss", "load_balancing_loss"), curve[it], serial[it]):
                assert math.isclose(a, b, rel_tol=1e-5), f"{name}: {what} at iteration {it}: {a} vs serial {b}"
