"""The inference engine under model parallelism: TP=2 and PP=2 (2 gloo ranks; rank 0 owns the requests and broadcasts
each step's plan, rank 1 follows) give each of 17 requests arriving at random steps the TP=1 engine's greedy tokens
and log-probs: TP=2 for a Llama-like (GQA) and an MLA model with sequence parallelism on, PP=2 for the Llama-like
one (P2P hidden states, the logits broadcast from the last stage), in one subprocess run."""
from __future__ import annotations

import random

import torch

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.inference import InferenceEngine
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from megatron.models.gpt.model import GPTModel
from tests.dist_utils import run_distributed
from tests.inference.helpers import EOD, random_prompts, run
from tests.inference.test_engine import GREEDY, LAYOUTS, LLAMA, MLA
from tests.model.helpers import VOCAB, build_gpt, tiny_config
from tests.text_generation.test_generate_pp import stage_state_dict

FAMILIES = {"llama": LLAMA, "mla": MLA}
PROMPTS = random_prompts(17, VOCAB, seed=3)
ARRIVALS = [random.Random(i).randrange(12) for i in range(len(PROMPTS))]


def _tp2(rank: int, world_size: int, states: dict) -> dict:
    results = {}
    for name, overrides in FAMILIES.items():
        state = initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            config = tiny_config(**overrides, tensor_model_parallel_size=2, sequence_parallel=True)
            model = build_gpt(config, tp_rank=state.tp_rank, pp_state=state).eval()
            model.load_state_dict(split_tensor_parallel_state_dict(states[name], 2, config=config)[state.tp_rank])
            engine = InferenceEngine(model, LAYOUTS["both"], eod=EOD, state=state)
            if state.tp_rank == 0:
                results[name] = run(model, PROMPTS, LAYOUTS["both"], GREEDY, ARRIVALS, engine=engine)[0]
                engine.shutdown()
            else:
                engine.follow()
                assert engine.finished_signal and not engine.queue and engine.stats.steps == 0  # rank 0 counts
        finally:
            destroy_model_parallel()
    results["llama-pp2"] = _pp2(states["llama"])
    return results


def _pp2(full_state: dict):
    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        first, last = state.is_pipeline_first_stage(), state.is_pipeline_last_stage()
        model = GPTModel(tiny_config(**LLAMA, pipeline_model_parallel_size=2), pp_state=state, pre_process=first,
                         post_process=last)
        model.load_state_dict(stage_state_dict(full_state, tiny_config(**LLAMA), 2, state.pp_rank))
        engine = InferenceEngine(model.eval(), LAYOUTS["both"], eod=EOD, state=state)
        if not engine.leader:
            engine.follow()
            return None
        out = run(model, PROMPTS, LAYOUTS["both"], GREEDY, ARRIVALS, engine=engine)[0]
        engine.shutdown()
        return out
    finally:
        destroy_model_parallel()


def test_tp2_and_pp2_engines_equal_the_tp1_engine():
    models = {name: build_gpt(tiny_config(**overrides)).eval() for name, overrides in FAMILIES.items()}
    reference = {name: run(model, PROMPTS, LAYOUTS["both"], GREEDY, ARRIVALS)[0] for name, model in models.items()}
    per_rank = run_distributed(_tp2, world_size=2, args=({n: m.state_dict() for n, m in models.items()},))
    assert per_rank[1] == {"llama-pp2": None}
    for name, ref_name in [("llama", "llama"), ("mla", "mla"), ("llama-pp2", "llama")]:
        for i in range(len(PROMPTS)):
            tokens, logprobs, reason = per_rank[0][name][i]
            assert tokens == reference[ref_name][i][0] and reason == "length", (name, i)
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(reference[ref_name][i][1]), rtol=0,
                                       atol=1e-5)
