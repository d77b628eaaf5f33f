"""Context parallelism (--context-parallel-size) trains the serial run's 20-step curve (training and validation
losses within 1e-5 relative, grad norms) for a tiny Llama-style model (RoPE + GQA, RMSNorm, SwiGLU) under
CP2 (p2p ring), CP2 a2a, CP2 all_gather, CP2 + full and selective recompute, CP4, CP2 x TP2 + SP, CP2 x PP2 and
CP2 x DP2 with the distributed optimizer, and for a GPT with learned absolute positions under CP2 (also with
--reset-attention-mask --reset-position-ids: document masks take the masked ring path). Resuming CP2 at
iteration 10 reproduces iterations 11..20 exactly; the CP2 checkpoint loads at CP1 (CP shards no weights: one file
per TP/PP rank, as without CP) and continues on the serial curve.

Four launches in all (2, 1, 2 and 4 processes), each running several layouts one after another.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.training._llama import ITERS, LLAMA, assert_matches, curve_of, run_many
from tests.training._workers import tiny_gpt_argv

HALF = ITERS // 2


def _llama(data: dict, *extra: str) -> tuple[str, list[str]]:
    """2 layers, hidden 64, 4 heads in 2 query groups, seq 64, micro-batch 4 (2 per global batch of 8)."""
    return "stage", tiny_gpt_argv(data, *LLAMA, *extra, iters=ITERS)


def _gpt(data: dict, *extra: str) -> tuple[str, list[str]]:
    """The tiny GPT of the golden curves: learned absolute positions, LayerNorm, GeLU."""
    return "stage", tiny_gpt_argv(data, *extra, iters=ITERS)


CP2 = ["--context-parallel-size", "2"]
TWO = {  # name -> (model, extra flags), all on 2 processes
    "cp2": ("llama", CP2),
    "cp2-a2a": ("llama", [*CP2, "--cp-comm-type", "a2a"]),
    "cp2-all_gather": ("llama", [*CP2, "--cp-comm-type", "all_gather"]),
    "cp2-full-recompute": ("llama", [*CP2, "--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"]),
    "cp2-selective-recompute": ("llama", [*CP2, "--recompute-activations"]),
    "cp2-gpt-learned": ("gpt", CP2),
    "cp2-gpt-reset-attention-mask": ("gpt-reset", CP2),  # document masks: the model's masked (non-causal) path
}
RESET = ["--reset-attention-mask", "--reset-position-ids"]
FOUR = {
    "cp4": ("llama", ["--context-parallel-size", "4"]),
    "cp2-tp2-sp": ("llama", [*CP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2-pp2": ("llama", [*CP2, "--pipeline-model-parallel-size", "2"]),
    "cp2-dp2-distopt": ("llama", [*CP2, "--use-distributed-optimizer"]),
}


@pytest.mark.slow
def test_context_parallel_layouts_match_serial_resume_and_load_at_cp1(gpt_data: dict, tmp_path: Path) -> None:
    build = {"llama": _llama, "gpt": _gpt, "gpt-reset": lambda data, *extra: _gpt(data, *RESET, *extra)}
    save = ["--save", str(tmp_path / "cp2"), "--save-interval", str(HALF)]
    two = [build[model](gpt_data, *extra, *(save if name == "cp2" else [])) for name, (model, extra) in TWO.items()]
    by_rank = run_distributed(run_many, 2, args=(two,))
    two_results = by_rank[-1]  # the last rank prints the losses, rank 0 the layout
    assert ("> context parallel: size 2, attention a2a; sequence 64 in 4 chunks of 16 tokens, 32 per rank "
            "(rank 0: chunks 0 and 3; rank 1: chunks 1 and 2)") in by_rank[0][1]["stdout"]
    ckpt = tmp_path / "cp2" / f"iter_{HALF:07d}"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["mp_rank_00"]  # one writer per TP/PP rank

    # Serial references, and the CP2 checkpoint of iteration 10 loaded at CP1.
    (tmp_path / "cp2" / "latest_checkpointed_iteration.txt").write_text(str(HALF))
    one = [_llama(gpt_data), _gpt(gpt_data), _gpt(gpt_data, *RESET), _llama(gpt_data, "--load", str(tmp_path / "cp2"))]
    names = ("llama", "gpt", "gpt-reset", "cp1 from cp2")
    serial = {n: curve_of(r, n) for n, r in zip(names, run_distributed(run_many, 1, args=(one,))[0])}
    serial_llama, at_cp1 = serial["llama"], serial["cp1 from cp2"]
    assert serial_llama["train"][ITERS] < serial_llama["train"][1] - 0.1, "the tiny model should learn"
    assert serial["gpt-reset"]["train"] != serial["gpt"]["train"], "document masks should change the curve"
    for (name, (model, _)), result in zip(TWO.items(), two_results):
        assert_matches(curve_of(result, name), serial[model], name)
    assert_matches(at_cp1, serial_llama, "CP2 checkpoint loaded at CP1", iters=range(HALF + 1, ITERS + 1))

    # Exact resume at CP2.
    resumed = run_distributed(run_many, 2, args=([_llama(gpt_data, *CP2, "--load", str(tmp_path / "cp2"))],))
    again, full = curve_of(resumed[-1][0], "cp2 resumed"), curve_of(two_results[0], "cp2")
    assert sorted(again["train"]) == list(range(HALF + 1, ITERS + 1))
    for it in range(HALF + 1, ITERS + 1):  # identical to the last printed digit
        assert again["train"][it] == full["train"][it], (it, full["train"][it], again["train"][it])
    assert again["val"] == full["val"][1:]

    four = [build[model](gpt_data, *extra) for model, extra in FOUR.values()]
    for name, result in zip(FOUR, run_distributed(run_many, 4, args=(four,))[-1]):
        assert_matches(curve_of(result, name), serial_llama, name)
