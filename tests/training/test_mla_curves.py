"""A tiny multi-latent-attention GPT (q-lora, latent norms, RMSNorm, SwiGLU) trains the serial run's curve under
TP=2 + SP (losses within 1e-5 relative over 6 steps; Adam hides small gradient errors over so few
steps: every gradient is compared with TP=1 in tests/model/test_mla_tp.py).
Every run starts from the serial model's weights (tests/pipeline/_workers.py)."""
from __future__ import annotations

import math

from tests.dist_utils import run_distributed
from tests.training._llama import run_many
from tests.training._workers import curve_from_result, tiny_gpt_argv

ITERS = 6
MLA = ["--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "24", "--kv-lora-rank", "16",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--normalization", "RMSNorm",
       "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear", "--ffn-hidden-size", "96"]


def _curve(result: dict, what: str) -> dict:
    assert result["error"] is None, f"{what}: {result['error']}"
    return curve_from_result(result["result"])


def test_tp2_sp_matches_serial(gpt_data: dict) -> None:
    argv = tiny_gpt_argv(gpt_data, *MLA, iters=ITERS)
    ((serial,),) = run_distributed(run_many, 1, args=([("stage", argv)],))
    serial = _curve(serial, "serial")
    assert sorted(serial["train"]) == list(range(1, ITERS + 1))
    assert serial["train"][ITERS] < serial["train"][1]
    layouts = {"tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"]}
    results = run_distributed(run_many, 2, args=([("stage", argv + extra) for extra in layouts.values()],))
    for i, name in enumerate(layouts):
        curve = _curve(results[0][i], name)
        assert sorted(curve["train"]) == sorted(serial["train"]), name
        for it, loss in serial["train"].items():
            assert math.isclose(curve["train"][it], loss, rel_tol=1e-5), f"{name}: iteration {it}"
