"""Tensor parallelism: TP=2 (2 gloo ranks) generates exactly the TP=1 tokens, identically on both ranks."""
from __future__ import annotations

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from megatron.text_generation import generate
from tests.dist_utils import run_distributed
from tests.text_generation.helpers import PROMPTS, VOCAB, build_model

NEW = 10
CASES = [dict(greedy=True), dict(top_k=8, random_seed=7), dict(top_p=0.8, temperature=1.3, random_seed=9)]


def _run(model, **extra) -> list:
    return [generate(model, None, PROMPTS, NEW, eod_id=VOCAB - 1, return_output_log_probs=True, **c, **extra)
            for c in CASES]


def _body(rank: int, world_size: int, full_state: dict) -> list:
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        results = []
        for parallel_output in (True, False):
            model = build_model(tp_rank=state.tp_rank, tensor_model_parallel_size=2, pp_state=state,
                                parallel_output=parallel_output)
            model.load_state_dict(split_tensor_parallel_state_dict(full_state, 2)[state.tp_rank])
            results.append(_run(model, state=state))
        return results
    finally:
        destroy_model_parallel()


def test_tp2_generates_the_tp1_tokens():
    ref_model = build_model()
    reference = _run(ref_model)
    per_rank = run_distributed(_body, world_size=2, args=(ref_model.state_dict(),))
    for rank_results in per_rank:
        for outs in rank_results:  # parallel_output True (logits gathered here) and False
            for out, ref in zip(outs, reference):
                assert out["tokens"] == ref["tokens"]
                assert out["lengths"] == ref["lengths"]
                for a, b in zip(out["logprobs"], ref["logprobs"]):
                    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
