"""A 2-rank (TP=2) server: rank 0 answers over HTTP with the TP=1 greedy text, a bad request never reaches rank 1,
idle heartbeats keep the worker's collective alive, and both ranks leave cleanly at shutdown. In the same run, the
server on the inference engine under TP=2: 8 concurrent requests answered with the TP=1 greedy texts, and a client
that disconnects is cancelled by a step that runs no forward (the followers still leave their wait)."""
from __future__ import annotations

import functools
import json
import socket
import time

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.inference import EngineConfig, InferenceEngine, SamplingParams
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from megatron.text_generation import generate
from megatron.text_generation.disconnect import StopCheck
from megatron.text_generation.server import MegatronServer, build_server
from tests.dist_utils import run_distributed
from tests.text_generation.test_engine_server import wait_until
from tests.text_generation.test_server_http import CONTEXT, put, tiny_gpt, tiny_tokenizer
from tools.benchmarks.bench_serving import load_test

PROMPTS = ["The meaning of life is", "Hello"]
ENGINE_PROMPTS = [f"{w} {i}" for i, w in enumerate(["The cat", "Hello", "Once upon", "A B", "Why"] * 2)][:8]


def _engine_server(model, tokenizer):
    engine = InferenceEngine(model, EngineConfig(num_blocks=64, block_size=8), eod=int(tokenizer.eod))
    return build_server(model, tokenizer, max_sequence_length=CONTEXT, engine=engine,
                        sampling_params=SamplingParams, log=lambda msg: None), engine


def _engine_part(model, tokenizer) -> dict:
    """Rank 0: concurrent requests, then a client that leaves (its cancellation is a step without a forward)."""
    server, engine = _engine_server(model, tokenizer)
    address = server.start("127.0.0.1", 0)
    bodies = [{"prompts": [p], "tokens_to_generate": 4 + i % 3, "temperature": 0} for i, p in enumerate(ENGINE_PROMPTS)]
    results, _ = load_test(address, bodies, 4, path="/api", timeout_s=120, deadline_s=300)
    conn = socket.create_connection(address)
    body = json.dumps({"prompt": "Hello world", "max_tokens": 40, "stream": True}).encode()
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    assert wait_until(lambda: engine.stats.running == 1)
    with server.lock:
        conn.close()
    cancelled = wait_until(lambda: server.cancelled_requests == 1 and not engine.has_work())
    after = put(address, {"prompts": ["Hello"], "tokens_to_generate": 3, "temperature": 0})
    server.shutdown()
    return {"texts": [r["answer"]["text"][0] for r in results], "cancelled": cancelled, "after": after,
            "free": (engine.stats.free_blocks, engine.stats.total_blocks)}


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
            _engine_server(model, tokenizer)[0].worker_loop()
            return {"calls": calls}
        address = server.start("127.0.0.1", 0)
        time.sleep(0.7)  # a few heartbeats while idle
        bad = put(address, {"prompts": ["x"], "top_p": 3})
        good = put(address, {"prompts": PROMPTS, "tokens_to_generate": 5, "temperature": 0})
        server.shutdown()
        return {"calls": calls, "bad": bad, "good": good, "engine": _engine_part(model, tokenizer)}
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
    engine = rank0["engine"]
    for i, text in enumerate(engine["texts"]):
        assert text == generate(ref_model, tiny_tokenizer(shared_data), [ENGINE_PROMPTS[i]], 4 + i % 3,
                                greedy=True)["text"][0], i
    assert engine["cancelled"] and engine["free"][0] == engine["free"][1]
    assert engine["after"][0] == 200
    assert engine["after"][1]["text"] == generate(ref_model, tiny_tokenizer(shared_data), ["Hello"], 3,
                                                  greedy=True)["text"]
