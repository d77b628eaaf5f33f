"""Packed rows and --calculate-per-token-loss in training (pretrain_gpt.py, tiny Llama-style model, plain SGD
without clipping so the curve follows the gradient's size, not only its direction): on a packed chat-like dataset
(tests/training/_packed_data.py: 4 documents per row of 64, prompts and end padding out of the loss) the 4-step
curve is the same for 4 micro-batches per global batch (1 row each), DP2, DP2 with the distributed optimizer, TP2 + SP,
PP2, CP2 (p2p) and CP2 (a2a) on packed rows, and for the unpacked run that serves every document in a padded row
of its own. Without the flag the unpacked run's curve differs (mean of micro-batch means).

Two launches: one process (three runs) and two processes (six runs)."""
from __future__ import annotations

import math

import pytest

from tests.dist_utils import run_distributed
from tests.ds._workers import run_pretrain_ds
from tests.training._llama import LLAMA
from tests.training._packed_data import DOCS_PER_ROW, datasets_provider
from tests.training._workers import curve_from_result, tiny_gpt_argv

ITERS = 4
ROWS = 4  # packed rows per global batch


def _argv(data: dict, packed: bool, micro: int, *extra: str, per_token: bool = True) -> list[str]:
    rows = ROWS * (1 if packed else DOCS_PER_ROW)
    return tiny_gpt_argv(data, *LLAMA, "--micro-batch-size", str(micro), "--global-batch-size", str(rows),
                         "--optimizer", "sgd", "--lr", "0.5", "--min-lr", "0.5", "--lr-decay-style", "constant",
                         "--lr-warmup-iters", "0", "--weight-decay", "0", "--clip-grad", "0",
                         "--eval-interval", "100", "--eval-iters", "1",
                         *(["--calculate-per-token-loss"] if per_token else []), *extra, iters=ITERS)


def run_packed(rank: int, world_size: int, runs: list[tuple[bool, list[str]]]) -> list[dict]:
    """Several runs in one process group, each from the serial model's initial weights."""
    from tests.harness import entry_providers
    from tests.pipeline._workers import serial_init_provider

    provider = serial_init_provider(entry_providers("pretrain_gpt").model_provider)
    return [run_pretrain_ds(rank, world_size, argv, model_provider=provider, datasets_provider=datasets_provider(p))
            for p, argv in runs]


def _curve(result: dict, what: str) -> dict:
    assert result["error"] is None, f"{what}: {result['error']}"
    return curve_from_result(result["result"])


def _assert_same(curve: dict, ref: dict, what: str, rel: float = 1e-5) -> None:
    assert sorted(curve["train"]) == list(range(1, ITERS + 1)), what
    for it in range(1, ITERS + 1):
        a, b = curve["train"][it], ref["train"][it]
        assert math.isclose(a, b, rel_tol=rel), f"{what}: iteration {it}: {a} vs {b}"
    for (_, a), (_, b) in zip(curve["val"], ref["val"]):
        assert math.isclose(a, b, rel_tol=rel), f"{what}: validation {a} vs {b}"


@pytest.mark.slow
def test_per_token_curve_is_the_same_for_every_split_layout_and_packing(gpt_data: dict) -> None:
    one = [(True, _argv(gpt_data, True, 1)), (False, _argv(gpt_data, False, 4)),
           (False, _argv(gpt_data, False, 4, per_token=False))]
    serial = [_curve(r, n) for r, n in zip(run_distributed(run_packed, 1, args=(one,))[0],
                                           ("packed", "unpacked", "unpacked mean"))]
    ref = serial[0]
    assert ref["train"][ITERS] < ref["train"][1] - 0.1, "the tiny model should learn"
    _assert_same(serial[1], ref, "unpacked")
    assert not math.isclose(serial[2]["train"][2], ref["train"][2], rel_tol=1e-4), "the flag should matter"

    two = {
        "dp2": _argv(gpt_data, True, 2),
        "dp2-distopt": _argv(gpt_data, True, 1, "--use-distributed-optimizer"),
        "tp2-sp": _argv(gpt_data, True, 2, "--tensor-model-parallel-size", "2", "--sequence-parallel"),
        "pp2": _argv(gpt_data, True, 1, "--pipeline-model-parallel-size", "2"),
        "cp2-p2p": _argv(gpt_data, True, 2, "--context-parallel-size", "2"),
        "cp2-a2a": _argv(gpt_data, True, 2, "--context-parallel-size", "2", "--cp-comm-type", "a2a"),
    }
    results = run_distributed(run_packed, 2, args=([(True, argv) for argv in two.values()],))[-1]
    for name, result in zip(two, results):
        _assert_same(_curve(result, name), ref, name)
