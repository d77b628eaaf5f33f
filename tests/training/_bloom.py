"""The tiny BLOOM of the parity curves (ALiBi with 6 heads: not a power of two, 3 per TP rank; --embed-layernorm;
LayerNorm, biases, tanh GeLU, tied embeddings; 4 layers, hidden 48, seq 64, micro-batch 2, fp32, no dropout, 20
steps with validation at 10 and 20, lr 6e-3) and its serial reference (once per pytest session). Every run starts
from the serial model's initial weights; the run helpers are the Llama curves' (tests/training/_llama.py).
"""
from __future__ import annotations

from tests.training._llama import curve_of, run_many
from tests.training._workers import tiny_gpt_argv

ITERS = 20
BLOOM = ["--position-embedding-type", "alibi", "--embed-layernorm", "--hidden-size", "48",
         "--num-attention-heads", "6", "--num-layers", "4", "--micro-batch-size", "2", "--eval-interval", "10",
         "--lr", "6e-3", "--min-lr", "6e-4"]  # a larger lr than the GPT curves': visible learning in 20 steps

_SERIAL: dict = {}


def bloom_argv(data: dict, *extra: str) -> list[str]:
    return tiny_gpt_argv(data, *BLOOM, *extra, iters=ITERS)


def serial_curve(data: dict) -> dict:
    """The serial run's curve (once per session)."""
    if data["prefix"] not in _SERIAL:
        from tests.dist_utils import run_distributed

        ((res,),) = run_distributed(run_many, 1, args=([("stage", bloom_argv(data))],))
        curve = curve_of(res, "serial")
        assert sorted(curve["train"]) == list(range(1, ITERS + 1)) and len(curve["val"]) >= 2
        assert curve["train"][ITERS] < curve["train"][1] - 0.1, f"the tiny BLOOM should learn: {curve['train']}"
        assert max(curve["grad_norm"].values()) > 1.0, "--clip-grad 1.0 should be active in some steps"
        _SERIAL[data["prefix"]] = curve
    return _SERIAL[data["prefix"]]
