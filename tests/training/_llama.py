"""The tiny Llama-style model of the parity curves and its serial reference (computed once per pytest session).

Llama-style: RMSNorm, SwiGLU, RoPE, GQA with 2 query groups (4 heads), untied output layer, no linear biases; 8 layers,
hidden 64, micro-batch 1 (8 micro-batches per global batch of 8), fp32, no dropout, 12 steps with validation at 6
and 12. Every run starts from the serial model's initial weights (tests/pipeline/_workers.py).
"""
from __future__ import annotations

import contextlib
import math
import re
from typing import Any

from tests.training._workers import parse_losses, tiny_gpt_argv

ITERS = 20
REL = 1e-5
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--ffn-hidden-size", "96"]
SHAPE = ["--num-layers", "8", "--micro-batch-size", "1", "--eval-interval", "6"]
GRAD_NORM_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.]+) \|")

_SERIAL: dict = {}


def llama_argv(data: dict, *extra: str) -> list[str]:
    return tiny_gpt_argv(data, *LLAMA, *SHAPE, *extra, iters=ITERS)


def curve_of(result: dict, what: str) -> dict:
    """Losses and grad norms of one run's printed log (the last pipeline stage prints them)."""
    assert result["error"] is None, f"{what}: {result['error']}"
    curve = parse_losses(result["stdout"])
    curve["grad_norm"] = {int(m.group(1)): float(m.group(2)) for m in GRAD_NORM_RE.finditer(result["stdout"])}
    return curve


def run_many(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> list[dict]:
    """Several pretrain_gpt runs in one process group; `init` 'stage' or 'pipe' picks the serial-init wrapper."""
    from tests.ds._pipe_workers import serial_init_pipe_models
    from tests.ds._workers import run_pretrain_ds
    from tests.harness import entry_providers
    from tests.pipeline._workers import serial_init_provider

    base = entry_providers("pretrain_gpt").model_provider
    out = []
    for init, argv in runs:
        # 'stage': the entry script's provider copies the serial weights; 'pipe': the DeepSpeed backend's
        # GPTModelPipe does (under DeepSpeed's pipeline engine the backend, not model_provider, builds the model).
        provider = serial_init_provider(base) if init == "stage" else None
        with serial_init_pipe_models() if init == "pipe" else contextlib.nullcontext():
            out.append(run_pretrain_ds(rank, world_size, argv, model_provider=provider))
    return out


def serial_curve(data: dict) -> dict:
    """The serial run's curve (once per session, shared by tests/training and tests/ds)."""
    if data["prefix"] not in _SERIAL:
        from tests.dist_utils import run_distributed

        ((res,),) = run_distributed(run_many, 1, args=([("stage", llama_argv(data))],))
        curve = curve_of(res, "serial")
        assert sorted(curve["train"]) == list(range(1, ITERS + 1)) and len(curve["val"]) >= 2
        assert curve["train"][ITERS] < curve["train"][1] - 0.1, "the tiny Llama should learn within ITERS steps"
        assert max(curve["grad_norm"].values()) > 1.0, "--clip-grad 1.0 should be active in some steps"
        _SERIAL[data["prefix"]] = curve
    return _SERIAL[data["prefix"]]


def assert_matches(curve: dict, ref: dict, what: str, iters: Any = None) -> None:
    """Training losses (and validation, grad norms on full runs) equal the serial run's within REL."""
    iters = list(iters or range(1, ITERS + 1))
    assert sorted(curve["train"]) == iters, f"{what}: iterations {sorted(curve['train'])}"
    for it in iters:
        a, b = curve["train"][it], ref["train"][it]
        assert math.isclose(a, b, rel_tol=REL), f"{what}: iteration {it}: {a} vs serial {b}"
    if len(iters) == ITERS:
        assert [p for p, _ in curve["val"]] == [p for p, _ in ref["val"]], f"{what}: validation points differ"
        for (p, a), (_, b) in zip(curve["val"], ref["val"]):
            assert math.isclose(a, b, rel_tol=REL), f"{what}: validation at {p}: {a} vs {b}"
        assert sorted(curve["grad_norm"]) == iters, f"{what}: grad norms missing"
        for it in iters:
            a, b = curve["grad_norm"][it], ref["grad_norm"][it]
            assert math.isclose(a, b, rel_tol=2e-3, abs_tol=2e-3), f"{what}: grad norm at {it}: {a} vs {b}"
