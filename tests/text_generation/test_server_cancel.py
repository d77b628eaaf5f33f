"""Cancel on disconnect (loopback): a client that sends a long generation request and goes away stops that
generation within a few decoding steps (PUT /api, POST /v1/completions, streamed or not), so a second client's
request is answered long before the first one's full generation would have ended; under TP=2 both ranks stop at
the same step; a client that leaves while its request waits for the lock never reaches the model; and the socket test
tells closed, open and pipelined apart."""
from __future__ import annotations

import functools
import json
import socket
import threading
import time

import pytest

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from megatron.models.gpt.model import GPTModel
from megatron.text_generation import generate
from megatron.text_generation.disconnect import client_gone
from megatron.text_generation.server import MegatronServer, build_server
from tests.dist_utils import run_distributed
from tests.text_generation.test_server_http import call, tiny_gpt, tiny_tokenizer

LONG_CONTEXT = 1024
LONG = 1000  # tokens the first client asks for
PROMPT = "The meaning of life is"


def long_gpt(tp: int = 1, tp_rank: int = 0, **kwargs) -> GPTModel:
    """The tiny 2-layer GPT with a 1,024-token context (a long request is ~1,000 decoding steps)."""
    return tiny_gpt(tp, tp_rank, context=LONG_CONTEXT, **kwargs)


class Log:
    """The server's log callback: `wait(prefix)` until a line starting with `prefix` has been logged."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def __call__(self, msg: str) -> None:
        with self.changed:
            self.lines.append(msg)
            self.changed.notify_all()

    def wait(self, prefix: str, since: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: any(x.startswith(prefix) for x in self.lines[since:]), timeout=60)


@pytest.fixture(scope="module")
def long_served(shared_data):
    model, tokenizer = long_gpt(), tiny_tokenizer(shared_data)
    log = Log()
    server = build_server(model, tokenizer, max_sequence_length=LONG_CONTEXT, max_tokens_to_generate=LONG, log=log)
    address = server.start("127.0.0.1", 0)
    generate(model, tokenizer, [PROMPT], 2, greedy=True)  # warm-up
    started = time.perf_counter()  # about a lower bound of the long request's time: 20 steps' time x 50 (steps
    generate(model, tokenizer, [PROMPT], LONG // 50, greedy=True)  # slow down as the context grows)
    full_s = (time.perf_counter() - started) * 50
    yield server, address, log, full_s, model, tokenizer
    server.shutdown()


def _send(address, method: str, path: str, payload: dict) -> socket.socket:
    body = json.dumps(payload).encode()
    sock = socket.create_connection(address, timeout=60)
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


REQUESTS = {
    "api": ("PUT", "/api", {"prompts": [PROMPT], "tokens_to_generate": LONG, "temperature": 0}),
    "completions": ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0}),
    "stream": ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}),
}


@pytest.mark.parametrize("kind", list(REQUESTS))
def test_a_client_that_disconnects_stops_its_generation(long_served, kind):
    server, address, log, full_s, model, tokenizer = long_served
    method, path, payload = REQUESTS[kind]
    before, since = server.cancelled_requests, len(log.lines)
    first = _send(address, method, path, payload)
    assert log.wait("openai completion" if kind != "api" else "request:", since), log.lines[-3:]
    if kind == "stream":
        assert first.recv(1)  # the stream has begun
    first.close()
    gone_at = time.perf_counter()
    status, body = call(address, "PUT", "/api", json.dumps({"prompts": ["Hello"], "tokens_to_generate": 4,
                                                              "temperature": 0}).encode())
    waited = time.perf_counter() - gone_at
    assert status == 200 and body["text"] == generate(model, tokenizer, ["Hello"], 4, greedy=True)["text"]
    assert server.cancelled_requests == before + 1
    assert server.last_cancel_steps < LONG // 4, server.last_cancel_steps  # stopped within a few steps
    print(f"{kind}: second client answered {waited:.3f} s after the first left (after "
          f"{server.last_cancel_steps} of {LONG} steps); the full generation takes > {full_s:.3f} s")
    assert waited < full_s / 2


def test_a_client_that_leaves_while_queued_never_reaches_the_model(long_served):
    server, address, log, _, _, _ = long_served
    before, since = server.cancelled_requests, len(log.lines)
    with server.lock:  # a request in progress: the next one waits for its turn
        queued = _send(address, "PUT", "/api", REQUESTS["api"][2])
        queued.close()
    assert log.wait("request dropped", since)
    assert not any(line.startswith("request:") for line in log.lines[since:])
    assert server.cancelled_requests == before


def test_client_gone_tells_closed_open_and_pipelined_apart():
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
        conn.settimeout(30)  # as the server's handlers: a timeout must not make the test block
        assert client_gone(conn) is False  # open, nothing sent
        client.sendall(b"GET / HTTP/1.1\r\n")
        assert conn.recv(1, socket.MSG_PEEK)  # arrived
        assert client_gone(conn) is False and conn.recv(100)  # bytes waiting are not a disconnect (and stay)
        client.close()
        assert conn.recv(1, socket.MSG_PEEK) == b""  # the end of file has arrived
        assert client_gone(conn) is True
        conn.close()
        assert client_gone(conn) is True  # closed here
        assert client_gone(None) is False
    finally:
        listener.close()


def _tp2_body(rank: int, world_size: int, full_state: dict, shared_data) -> dict:
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        model = long_gpt(tp=2, tp_rank=state.tp_rank, pp_state=state)
        model.load_state_dict(split_tensor_parallel_state_dict(full_state, 2)[state.tp_rank])
        tokenizer = tiny_tokenizer(shared_data)
        outcomes = []  # (cancelled, lengths) of every generate call on this rank

        @functools.wraps(generate)
        def recorded(*args, **kwargs):
            out = generate(model, tokenizer, *args, **kwargs)
            outcomes.append((out["cancelled"], out["lengths"]))
            return out

        log = Log()
        server = MegatronServer(recorded, lambda text: len(tokenizer.tokenize(text)),
                                max_sequence_length=LONG_CONTEXT, log=log)
        if rank != 0:
            server.worker_loop()
            return {"outcomes": outcomes}
        address = server.start("127.0.0.1", 0)
        first = _send(address, *REQUESTS["api"][:2], REQUESTS["api"][2])
        assert log.wait("request:", 0)
        first.close()
        second = call(address, "PUT", "/api", json.dumps({"prompts": ["Hello"], "tokens_to_generate": 4,
                                                           "temperature": 0}).encode())
        server.shutdown()
        return {"outcomes": outcomes, "second": second, "steps": server.last_cancel_steps}
    finally:
        destroy_model_parallel()


def test_tp2_ranks_stop_together_and_serve_the_next_request(shared_data):
    """Under TP=2 the worker rank leaves the decoding loop at the same step as rank 0, and the next request (the
    collectives still in lockstep) gets the TP=1 answer."""
    ref_model = long_gpt()
    reference = generate(ref_model, tiny_tokenizer(shared_data), ["Hello"], 4, greedy=True)
    rank0, rank1 = run_distributed(_tp2_body, world_size=2, args=(ref_model.state_dict(), shared_data))
    assert rank0["second"][0] == 200 and rank0["second"][1]["text"] == reference["text"]
    assert rank0["outcomes"] == rank1["outcomes"]  # same step, same tokens on both ranks
    (cancelled, lengths), (done, _) = rank0["outcomes"]
    assert cancelled and not done
    assert rank0["steps"] < LONG // 4 and lengths[0] < len(tiny_tokenizer(shared_data).tokenize(PROMPT)) + LONG // 4


def test_a_streaming_client_that_never_reads_is_cancelled_after_the_stall_timeout(shared_data):
    """The stream's writer gives up on a client that reads nothing for the stall timeout (--request-timeout, here
    1 s); the generation stops at the next step instead of running its 1,000 steps, and the next client is served."""
    log = Log()
    model, tokenizer = long_gpt(), tiny_tokenizer(shared_data)
    server = build_server(model, tokenizer, max_sequence_length=LONG_CONTEXT, max_prompts=16, request_timeout_s=1,
                          log=log)
    address = server.start("127.0.0.1", 0)
    try:  # 16 prompts x ~3 kB of model name per event: the socket buffers are full after a few steps
        body = json.dumps({"model": "m" * 3000, "prompt": [PROMPT] * 16, "max_tokens": LONG, "temperature": 0,
                           "stream": True}).encode()
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(address)
        sent = time.perf_counter()
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert log.wait("openai completion (stream) cancelled", 0), log.lines[-3:]
        print(f"never-reading stream: cancelled {time.perf_counter() - sent:.2f} s after it was sent, after "
              f"{server.last_cancel_steps} of {LONG} steps")
        assert server.last_cancel_steps < LONG, server.last_cancel_steps
        assert any("read nothing for 1 s" in line for line in log.lines)
        status, answer = call(address, "PUT", "/api", json.dumps({"prompts": ["Hello"], "tokens_to_generate": 4,
                                                                   "temperature": 0}).encode())
        assert status == 200 and answer["text"] == generate(model, tokenizer, ["Hello"], 4, greedy=True)["text"]
        stalled.close()
    finally:
        server.shutdown()
