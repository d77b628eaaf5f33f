"""Pipeline parallelism: PP=2 (and TP=2 x PP=2) generation gives the PP=1 tokens and log-probs on every rank.

The stages get their slice of one serial model's weights (`stage_state_dict`, also used by tests/tasks/test_eval_pp.py
to write PP checkpoints). Greedy, top-k and top-p sampling are compared, with and without the KV cache, and the
HTTP server's worker loop serves a PP=2 model unchanged.
"""
from __future__ import annotations

import argparse
import functools

import pytest
import torch

from megatron.core.parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from megatron.models.gpt.model import GPTModel
from megatron.text_generation import generate
from megatron.text_generation.model_loading import InferenceLoadError, load_model_for_inference
from megatron.text_generation.server import MegatronServer
from tests.dist_utils import run_distributed
from tests.text_generation.helpers import PROMPTS, VOCAB, tiny_config
from tests.text_generation.test_server_http import put, tiny_tokenizer

NEW, LAYERS = 8, 4
CASES = [dict(greedy=True), dict(greedy=True, use_kv_cache=False), dict(top_k=8, random_seed=7),
         dict(top_p=0.8, temperature=1.3, random_seed=9)]


def stage_state_dict(flat: dict, config, pp_size: int, pp_rank: int) -> dict:
    """Flat state dict of pipeline stage `pp_rank` cut from a flat PP=1 state dict (layers renumbered from 0).

    `config` is the TP=1 config (only the names matter, so `flat` may be one tensor-parallel shard).
    """
    import dataclasses

    config = dataclasses.replace(config, pipeline_model_parallel_size=pp_size)
    fake = ParallelState(pp_size=pp_size, pp_rank=pp_rank, pp_ranks=list(range(pp_size)))
    stage = GPTModel(config, pp_state=fake, pre_process=pp_rank == 0, post_process=pp_rank == pp_size - 1)
    layers = stage.language_model.encoder.layers
    out = {}
    for name in stage.state_dict():
        if name == "word_embeddings.weight":  # the last stage's copy of the tied embedding
            src = "language_model.embedding.word_embeddings.weight"
        elif ".layers." in name:
            head, rest = name.split(".layers.", 1)
            local, tail = rest.split(".", 1)
            src = f"{head}.layers.{layers[int(local)].layer_number - 1}.{tail}"
        else:
            src = name
        out[name] = flat[src].clone()
    return out


def _run(model, **extra) -> list:
    return [generate(model, None, PROMPTS, NEW, eod_id=VOCAB - 1, return_output_log_probs=True, **c, **extra)
            for c in CASES] + [generate(model, None, [[3, 4, 5, 6]] * 2, 0, eod_id=VOCAB - 1,
                                        return_output_log_probs=True, **extra)]  # score-only path


def _stage_model(state: ParallelState, full_state: dict, tp: int, **config) -> GPTModel:
    """This rank's pipeline stage (and TP shard) holding the serial model's weights."""
    flat = split_tensor_parallel_state_dict(full_state, tp)[state.tp_rank] if tp > 1 else full_state
    model = GPTModel(tiny_config(num_layers=LAYERS, tensor_model_parallel_size=tp, pipeline_model_parallel_size=2,
                                 **config), pp_state=state, parallel_output=False,
                     pre_process=state.is_pipeline_first_stage(), post_process=state.is_pipeline_last_stage())
    model.load_state_dict(stage_state_dict(flat, tiny_config(num_layers=LAYERS, **config), 2, state.pp_rank))
    return model.eval()


def _body(rank: int, world_size: int, full_state: dict, tp: int) -> list:
    state = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=2)
    try:
        return _run(_stage_model(state, full_state, tp), state=state)
    finally:
        destroy_model_parallel()


def _server_body(rank: int, world_size: int, full_state: dict, shared_data, prompts: list) -> object:
    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        model, tokenizer = _stage_model(state, full_state, 1, padded_vocab_size=5120), tiny_tokenizer(shared_data)
        server = MegatronServer(functools.partial(generate, model, tokenizer),
                                lambda text: len(tokenizer.tokenize(text)), max_sequence_length=64, log=lambda m: None)
        if rank != 0:
            server.worker_loop()
            return None
        address = server.start("127.0.0.1", 0)
        answer = put(address, {"prompts": prompts, "tokens_to_generate": 5, "temperature": 0, "logprobs": True})
        server.shutdown()
        return answer
    finally:
        destroy_model_parallel()


def _reference() -> tuple[dict, list]:
    torch.manual_seed(1234)
    model = GPTModel(tiny_config(num_layers=LAYERS)).eval()
    return model.state_dict(), _run(model)


def _check(per_rank: list, reference: list) -> None:
    for rank_results in per_rank:
        for out, ref in zip(rank_results, reference):
            assert out["tokens"] == ref["tokens"]
            assert out["lengths"] == ref["lengths"]
            for a, b in zip(out["logprobs"], ref["logprobs"]):
                assert len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b)), default=0) < 1e-5


def test_pp2_generates_the_pp1_tokens():
    full_state, reference = _reference()
    _check(run_distributed(_body, world_size=2, args=(full_state, 1)), reference)


def test_tp2_pp2_generates_the_pp1_tokens():
    full_state, reference = _reference()
    _check(run_distributed(_body, world_size=4, args=(full_state, 2)), reference)


def test_pp2_server_answers_with_the_pp1_text(shared_data):
    torch.manual_seed(4321)
    model = GPTModel(tiny_config(num_layers=LAYERS, padded_vocab_size=5120)).eval()
    prompts = ["The meaning of life is", "Hello"]
    ref = generate(model, tiny_tokenizer(shared_data), prompts, 5, greedy=True, return_output_log_probs=True)
    status, body = run_distributed(_server_body, world_size=2, args=(model.state_dict(), shared_data, prompts))[0]
    assert status == 200 and body["text"] == ref["text"]
    for a, b in zip(body["logprobs"], ref["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_virtual_pipeline_stages_are_refused():
    args = argparse.Namespace(num_layers_per_virtual_pipeline_stage=1)
    with pytest.raises(InferenceLoadError, match="--num-layers-per-virtual-pipeline-stage"):
        load_model_for_inference(args, ParallelState.single())
