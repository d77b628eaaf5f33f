"""A 2-rank (TP=2) server: rank 0 answers over HTTP with the TP=1 greedy text, a bad request never reaches rank 1,
idle heartbeats keep the worker's collective alive, and both ranks leave cleanly at shutdown."""
from __future__ import annotations

import functools
import time

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from megatron.text_generation import generate
from megatron.text_generation.disconnect import StopCheck
from megatron.text_generation.server import MegatronServer
from tests.dist_utils import run_distributed
from tests.text_generation.test_server_http import CONTEXT, put, tiny_gpt, tiny_tokenizer

PROMPTS = ["The meaning of life is", "Hello"]


def _body(rank: int, world_size: int, full_state: dict, shared_data) -> dict:
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        model = tiny_gpt(tp=2, tp_rank=state.tp_rank, pp_state=state)
        model.load_state_dict(split_tensor_parallel_state_dict(full_state, 2)[state.tp_rank])
        tokenizer = tiny_tokenizer(shared_data)
        calls = []

        @functools.wraps(generate)
        def counted(*args, **kwargs):
            calls.append({k: v for k, v in kwargs.items() if k != "should_stop"})
            assert isinstance(kwargs["should_stop"], StopCheck)  # the per-step cancel decision, on every rank
            return generate(model, tokenizer, *args, **kwargs)

        counted.__wrapped__ = functools.partial(generate, model, tokenizer)
        server = MegatronServer(counted, lambda text: len(tokenizer.tokenize(text)), max_sequence_length=CONTEXT,
                                heartbeat_s=0.2, log=lambda msg: None)
        if rank != 0:
            server.worker_loop()
            return {"calls": calls}
        address = server.start("127.0.0.1", 0)
        time.sleep(0.7)  # a few heartbeats while idle
        bad = put(address, {"prompts": ["x"], "top_p": 3})
        good = put(address, {"prompts": PROMPTS, "tokens_to_generate": 5, "temperature": 0})
        server.shutdown()
        return {"calls": calls, "bad": bad, "good": good}
    finally:
        destroy_model_parallel()


def test_tp2_server_answers_and_releases_workers(shared_data):
    ref_model = tiny_gpt()
    reference = generate(ref_model, tiny_tokenizer(shared_data), PROMPTS, 5, greedy=True)
    rank0, rank1 = run_distributed(_body, world_size=2, args=(ref_model.state_dict(), shared_data))
    assert rank0["bad"][0] == 400 and "top_p" in rank0["bad"][1]["message"]
    status, body = rank0["good"]
    assert status == 200 and body["text"] == reference["text"]
    # only the valid request reached the worker rank, with the same options (incl. the seed rank 0 chose)
    assert len(rank0["calls"]) == len(rank1["calls"]) == 1 and rank0["calls"] == rank1["calls"]
