"""Generation and scoring under TP=2 with sequence parallelism (required for MoE under TP, as in Megatron-LM) and
under expert parallelism: prompts of 7 and 8 tokens and one-token decoding steps (lengths that TP does not divide)
give the TP=1 tokens, and log-probs within 1e-5, from the same weights; the model is left sequence-parallel after.
"""
from __future__ import annotations

import torch

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.layers.tp_shards import split_tensor_parallel_state_dict, tensor_parallel_layouts
from megatron.models.gpt.model import GPTModel
from megatron.text_generation import generate
from megatron.text_generation.scoring import score_tokens
from tests.dist_utils import run_distributed
from tests.text_generation.helpers import VOCAB, tiny_config

NEW = 6
P7 = [5, 17, 33, 9, 2, 71, 40]
P8 = [100, 1, 64, 7, 7, 3, 88, 12]
PROMPT_SETS = [[P7], [P8], [P7, P8]]
MOE = dict(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, swiglu=True, ffn_hidden_size=48,
           normalization="RMSNorm", position_embedding_type="rope", moe_shared_expert_intermediate_size=32,
           moe_layer_freq=[1, 0])
DENSE: dict = {}


def _model(config_kw: dict, seed: int = 4321, tp_rank: int = 0, **kwargs) -> GPTModel:
    model_parallel_manual_seed(seed, tp_rank)
    return GPTModel(tiny_config(**config_kw), **kwargs).eval()


def _results(model: torch.nn.Module, state=None) -> dict:
    gen = [generate(model, None, prompts, NEW, eod_id=VOCAB - 1, greedy=True, return_output_log_probs=True,
                    use_eod_token_for_early_termination=False, state=state) for prompts in PROMPT_SETS]
    scored = score_tokens(model, [P7 + [3, 4], P8], vocab_size=VOCAB, state=state)
    return {"gen": gen, "scores": [s.logprobs for s in scored]}


def _close(a: list, b: list, tol: float = 1e-5) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b)) and len(a) == len(b)


def _assert_same(result: dict, reference: dict) -> None:
    for out, ref in zip(result["gen"], reference["gen"]):
        assert out["tokens"] == ref["tokens"] and out["lengths"] == ref["lengths"]
        assert all(_close(a, b) for a, b in zip(out["logprobs"], ref["logprobs"]))
    assert all(_close(a, b) for a, b in zip(result["scores"], reference["scores"]))


def _tp2_sp_body(rank: int, world_size: int, cases: dict) -> dict:
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        out = {}
        for name, (config_kw, full_state) in cases.items():
            kw = dict(config_kw, tensor_model_parallel_size=2, sequence_parallel=True)
            model = _model(kw, tp_rank=state.tp_rank, tp_group=state.tp_group, pp_state=state)
            layouts = tensor_parallel_layouts(tiny_config(**config_kw))
            model.load_state_dict(split_tensor_parallel_state_dict(full_state, 2, layouts=layouts)[state.tp_rank])
            out[name] = _results(model, state)
            # sequence parallelism is back on after generating (a training job may generate between steps)
            out[name]["sp_after"] = (model.sequence_parallel, model.config.sequence_parallel,
                                     model.language_model.embedding.sequence_parallel)
        return out
    finally:
        destroy_model_parallel()


def test_tp2_sequence_parallel_generates_the_tp1_tokens() -> None:
    cases, references = {}, {}
    for name, config_kw in (("moe", MOE), ("dense", DENSE)):
        ref_model = _model(config_kw)
        references[name] = _results(ref_model)
        cases[name] = (config_kw, ref_model.state_dict())
    per_rank = run_distributed(_tp2_sp_body, world_size=2, args=(cases,))
    for rank_results in per_rank:
        for name, reference in references.items():
            _assert_same(rank_results[name], reference)
            assert rank_results[name]["sp_after"] == (True, True, True)


def _ep_slice(full_state: dict, ep_rank: int, ep: int) -> dict:
    """This EP rank's experts (weight1/weight2 stacks are [E, ...]); everything else whole."""
    out = {}
    for key, value in full_state.items():
        if key.endswith(("mlp.experts.weight1", "mlp.experts.weight2")):
            n = value.shape[0] // ep
            value = value[ep_rank * n:(ep_rank + 1) * n]
        out[key] = value
    return out


def _ep2_body(rank: int, world_size: int, full_state: dict) -> dict:
    state = initialize_model_parallel(expert_model_parallel_size=2)
    try:
        out = {}
        for dispatcher in ("allgather", "alltoall"):
            model = _model(dict(MOE, expert_model_parallel_size=2, moe_token_dispatcher_type=dispatcher),
                           pp_state=state)
            model.load_state_dict(_ep_slice(full_state, state.ep_rank, 2))
            out[dispatcher] = _results(model, state)
        return out
    finally:
        destroy_model_parallel()


def test_ep2_generates_the_serial_tokens() -> None:
    ref_model = _model(MOE)
    reference = _results(ref_model)
    for rank_results in run_distributed(_ep2_body, world_size=2, args=(ref_model.state_dict(),)):
        for result in rank_results.values():
            _assert_same(result, reference)
