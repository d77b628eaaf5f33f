"""The server on an inference engine (megatron/text_generation/engine_driver.py). With megatron/inference's engine on
a tiny GPT: a load test of 64 requests from 16 concurrent clients (PUT /api and /v1/completions, streamed or not)
answers every one exactly as the static generator does for it alone (greedy), several requests sharing engine steps,
`PUT /api` with log-probs gives generate()'s (prompt included), and a client that disconnects has its request
cancelled and its KV blocks freed. With a stand-in engine of the same interface (tokens a fixed function of each
request, steps held by a gate): a full queue answers 429 with Retry-After on both routes; an engine refusal is a
400."""
from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass

import pytest

from megatron.errors import MegatronUserError
from megatron.inference import EngineConfig, InferenceEngine, SamplingParams
from megatron.text_generation import generate
from megatron.text_generation.engine_driver import EngineDriver, run_to_completion
from megatron.text_generation.server import MegatronServer, build_server
from tests.text_generation.test_server_http import call, put, tiny_gpt, tiny_tokenizer
from tools.benchmarks.bench_serving import load_test, summarize

CONTEXT = 64


@dataclass
class Params:
    """The SamplingParams fields the server fills."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    stop_token_ids: tuple = ()
    return_logprobs: bool = False
    return_prompt_logprobs: bool = False
    vocab_size: int | None = None


@dataclass
class Out:
    request_id: str
    new_tokens: list
    new_logprobs: list | None
    finished: bool
    finish_reason: str | None


def next_token(tokens: list[int]) -> int:
    """The stand-in model: the next token is a hash of the sequence so far (never the tiny vocabulary's eod)."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + 7) % 4000 + 10


def alone(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class FakeEngine:
    """The engine interface: at most `slots` requests run (the others wait), one token each per step; `gate`
    (cleared by a test) holds step(); `blocks_in_use` is what a paged cache would hold."""

    def __init__(self, slots: int = 8) -> None:
        self.slots = slots
        self.waiting: list[tuple[str, list[int], Params]] = []
        self.running: dict[str, tuple[list[int], int, Params]] = {}
        self.cancelled: list[str] = []
        self.most_running = 0
        self.steps = 0
        self.gate = threading.Event()
        self.gate.set()
        self.stepping = threading.Event()

    def add_request(self, request_id: str, prompt_tokens: list[int], params: Params) -> None:
        if len(prompt_tokens) + params.max_new_tokens > CONTEXT - 16:  # its "pool" is smaller than the context
            raise MegatronUserError(f"request {request_id} can never fit the KV cache; shorten it")
        self.waiting.append((request_id, list(prompt_tokens), params))

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self.waiting = [w for w in self.waiting if w[0] != request_id]
        self.running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def blocks_in_use(self) -> int:
        return len(self.running)

    def step(self) -> list[Out]:
        self.stepping.set()
        self.gate.wait(60)
        while self.waiting and len(self.running) < self.slots:
            rid, prompt, params = self.waiting.pop(0)
            self.running[rid] = (prompt, len(prompt), params)
        self.most_running = max(self.most_running, len(self.running))
        self.steps += 1
        outs = []
        for rid, (seq, n_prompt, params) in list(self.running.items()):
            token = next_token(seq)
            seq.append(token)
            done = len(seq) - n_prompt >= params.max_new_tokens or token in params.stop_token_ids
            outs.append(Out(rid, [token], None, done, ("stop" if token in params.stop_token_ids else "length")
                            if done else None))
            if done:
                del self.running[rid]
        return outs


def wait_until(condition, timeout_s: float = 30.0) -> bool:
    """Poll `condition` (another thread's progress) every 10 ms, at most `timeout_s`."""
    tick = threading.Event()
    for _ in range(int(timeout_s * 100)):
        if condition():
            return True
        tick.wait(0.01)
    return condition()


def start(shared_data, **kwargs):
    model, tokenizer = tiny_gpt(), tiny_tokenizer(shared_data)
    engine = FakeEngine()
    server = build_server(model, tokenizer, max_sequence_length=CONTEXT, engine=engine, sampling_params=Params,
                          log=lambda msg: None, **kwargs)
    return server, server.start("127.0.0.1", 0), engine, model, tokenizer


@pytest.fixture(scope="module")
def served(shared_data):
    server, address, engine, model, tokenizer = start(shared_data)
    yield server, address, engine, model, tokenizer
    server.shutdown()


def test_load_64_requests_from_16_clients_all_answered_as_alone(served):
    server, address, engine, _, tokenizer = served
    prompts = [[(7 * i + j) % 3000 + 20 for j in range(3 + i % 5)] for i in range(64)]
    lengths = [4 + i % 9 for i in range(64)]
    bodies = [{"prompt": p, "max_tokens": n, "temperature": 0, "stream": i % 2 == 0,
               **({"stream_options": {"include_usage": True}} if i % 2 == 0 else {})}
              for i, (p, n) in enumerate(zip(prompts, lengths))]
    results, wall = load_test(address, bodies, 16, timeout_s=60, deadline_s=120)
    summary = summarize(results, wall)
    assert summary["ok"] == 64 and summary["output_tokens"] == sum(lengths), summary
    for i, (r, p, n) in enumerate(zip(results, prompts, lengths)):
        text = tokenizer.detokenize(alone(p, n))
        got = r["answer"]["texts"][0] if i % 2 == 0 else r["answer"]["choices"][0]["text"]
        assert got == text, i
    assert engine.most_running > 1  # requests shared engine steps
    assert server.driver.in_flight == 0 and not engine.has_work()

    # PUT /api, several prompts in one request: Megatron's fields, prompt + generation
    texts = ["The quick brown fox", "Hello"]
    status, body = put(address, {"prompts": texts, "tokens_to_generate": 5, "temperature": 0})
    assert status == 200 and set(body) == {"text", "segments", "logprobs"} and body["logprobs"] is None
    for t, got, seg in zip(texts, body["text"], body["segments"]):
        ids = [int(x) for x in tokenizer.tokenize(t)]
        full = ids + alone(ids, 5)
        assert got == tokenizer.detokenize(full) and seg == [tokenizer.detokenize([x]) for x in full]


@pytest.fixture(scope="module")
def engine_served(shared_data):
    model, tokenizer = tiny_gpt(), tiny_tokenizer(shared_data)
    engine = InferenceEngine(model, EngineConfig(num_blocks=96, block_size=8, max_tokens=512), eod=int(tokenizer.eod))
    server = build_server(model, tokenizer, max_sequence_length=CONTEXT, engine=engine,
                          sampling_params=SamplingParams, log=lambda msg: None)
    address = server.start("127.0.0.1", 0)
    yield server, address, engine, model, tokenizer
    server.shutdown()


def test_real_engine_load_64_requests_16_clients_equal_alone(engine_served):
    server, address, engine, model, tokenizer = engine_served
    words = ["The quick brown fox", "Hello", "Once upon a time", "A B C", "Numbers 1 2 3 4", "Why"]
    prompts = [f"{words[i % 6]} {i}" for i in range(64)]
    lengths = [3 + i % 6 for i in range(64)]
    bodies = [{"prompt": p, "max_tokens": n, "temperature": 0, "stream": i % 3 == 0} for i, (p, n)
              in enumerate(zip(prompts, lengths))]
    api_rows = list(range(1, 64, 3))  # every third request is Megatron's PUT /api instead
    steps_before = engine.stats.steps
    results, wall = load_test(address, [b for i, b in enumerate(bodies) if i not in api_rows], 16, timeout_s=120,
                              deadline_s=300)
    api_results, _ = load_test(address, [{"prompts": [prompts[i]], "tokens_to_generate": lengths[i],
                                          "temperature": 0} for i in api_rows], 16, path="/api", timeout_s=120)
    assert all(r is not None and r["status"] == 200 for r in results + api_results)
    got = iter(results)
    got_api = iter(api_results)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        ref = generate(model, tokenizer, [p], n, greedy=True)
        if i in api_rows:
            assert next(got_api)["answer"]["text"] == ref["text"], i
            continue
        r = next(got)
        text = ref["text"][0][len(p):].split("<|endoftext|>")[0]
        answer = r["answer"]["texts"][0] if bodies[i]["stream"] else r["answer"]["choices"][0]["text"]
        assert answer == tokenizer.detokenize(ref["tokens"][0][len(tokenizer.tokenize(p)):]) or answer == text, i
    assert engine.stats.running == 0 and engine.stats.queued == 0
    assert engine.stats.free_blocks == engine.stats.total_blocks
    assert engine.stats.steps - steps_before < sum(lengths)  # alone, every token would be a step of its own


def test_real_engine_disconnect_frees_blocks(engine_served):
    server, address, engine, _, _ = engine_served
    before = server.cancelled_requests
    conn = socket.create_connection(address)
    body = json.dumps({"prompt": "Hello world", "max_tokens": 48, "stream": True}).encode()
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert conn.recv(12).startswith(b"HTTP/1.0 200")
    assert wait_until(lambda: engine.stats.running == 1)
    with server.lock:  # the driver's step lock: no step runs while the client leaves
        assert engine.stats.running == 1 and engine.stats.free_blocks < engine.stats.total_blocks
        conn.close()
    assert wait_until(lambda: server.cancelled_requests == before + 1 and server.driver.in_flight == 0)
    assert wait_until(lambda: not engine.has_work())
    assert engine.stats.free_blocks == engine.stats.total_blocks and engine.stats.running == 0


def test_api_logprobs_on_the_engine_equal_generate(engine_served):
    _, address, _, model, tokenizer = engine_served
    prompts = ["Hello there", "The quick brown fox jumps"]
    status, body = put(address, {"prompts": prompts, "tokens_to_generate": 3, "temperature": 0, "logprobs": True})
    assert status == 200
    for i, p in enumerate(prompts):
        ref = generate(model, tokenizer, [p], 3, greedy=True, return_output_log_probs=True)
        assert body["text"][i] == ref["text"][0] and body["segments"][i] == ref["segments"][0]
        assert body["logprobs"][i] == pytest.approx(ref["logprobs"][0], abs=1e-5)


def test_engine_refusal_is_a_400(served):
    _, address, _, _, _ = served
    status, body = call(address, "POST", "/v1/completions",
                        json.dumps({"prompt": [5] * 40, "max_tokens": 20}).encode(),
                        {"Content-Type": "application/json"})
    assert status == 400 and "can never fit" in body["error"]["message"]


def test_full_queue_answers_429_with_retry_after(shared_data):
    server, address, engine, _, _ = start(shared_data, max_queued_requests=2)
    try:
        engine.gate.clear()
        engine.stepping.clear()
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(put(address, {"prompts": ["Hi"],
                                                                               "tokens_to_generate": 2})))
                   for _ in range(2)]
        for t in threads:
            t.start()
        assert engine.stepping.wait(30)
        assert wait_until(lambda: server._held == 2)
        conn = socket.create_connection(address)
        body = json.dumps({"prompts": ["Hi"], "tokens_to_generate": 2}).encode()
        conn.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = b"".join(iter(lambda: conn.recv(65536), b"")).decode()  # the server closes after answering
        conn.close()
        assert head.startswith("HTTP/1.0 429") or head.startswith("HTTP/1.1 429"), head
        assert "Retry-After: 1" in head and "--max-queued-requests" in head
        status, err = call(address, "POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
                           {"Content-Type": "application/json"})
        assert status == 429 and err["error"]["type"] == "rate_limit_error"
        engine.gate.set()
        for t in threads:
            t.join(60)
        assert [a[0] for a in answers] == [200, 200]
        assert server._held == 0
    finally:
        engine.gate.set()
        server.shutdown()


def test_disconnect_cancels_the_engine_request(shared_data):
    server, address, engine, _, _ = start(shared_data)
    try:
        engine.gate.clear()
        engine.stepping.clear()
        conn = socket.create_connection(address)
        body = json.dumps({"prompt": "Hello", "max_tokens": 40, "stream": True}).encode()
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert engine.stepping.wait(30)
        assert len(engine.running) + len(engine.waiting) == 1
        conn.close()
        engine.gate.set()  # the step in progress ends; the driver sees the closed socket before the next one
        assert wait_until(lambda: server.driver.in_flight == 0 and server.cancelled_requests == 1)
        assert len(engine.cancelled) == 1 and not engine.has_work() and engine.blocks_in_use == 0
        assert server.cancelled_requests == 1 and server.driver.cancelled_requests == 1
    finally:
        engine.gate.set()
        server.shutdown()


def test_driver_alone_fails_requests_when_stopped_and_reports_engine_errors():
    engine = FakeEngine()
    driver = EngineDriver(engine)
    driver.start()
    (ticket,) = driver.submit([[1, 2, 3]], Params(max_new_tokens=5))
    assert ticket.wait().tokens == alone([1, 2, 3], 5) and ticket.finish_reason == "length"
    (bad,) = driver.submit([[1] * 60], Params(max_new_tokens=10))
    with pytest.raises(MegatronUserError, match="never fit"):
        bad.wait()
    engine.gate.clear()
    engine.stepping.clear()
    (held,) = driver.submit([[4, 5]], Params(max_new_tokens=5))
    assert engine.stepping.wait(30)
    stopper = threading.Thread(target=driver.stop)
    stopper.start()
    engine.gate.set()
    stopper.join(30)
    assert held.done.is_set()


def test_run_to_completion_submits_everything_at_once():
    engine = FakeEngine(slots=3)
    prompts = [[i, i + 1, 2 * i] for i in range(1, 8)]
    tickets = run_to_completion(engine, prompts, Params(max_new_tokens=4))
    assert [t.tokens for t in tickets] == [alone(p, 4) for p in prompts]
    assert {t.finish_reason for t in tickets} == {"length"}
    assert engine.most_running == 3 and not engine.has_work()
    with pytest.raises(MegatronUserError, match="never fit"):
        run_to_completion(FakeEngine(), [[1] * 60], Params(max_new_tokens=4))


def test_full_queue_429_on_the_static_path_too():
    """--max-queued-requests bounds today's one-at-a-time server as well: a request past it gets 429 + Retry-After."""
    release, entered = threading.Event(), threading.Event()

    def held_generate(prompts, tokens_to_generate, **options):
        entered.set()
        release.wait(60)
        return {"text": list(prompts), "segments": [[p] for p in prompts]}

    server = MegatronServer(held_generate, len, max_sequence_length=CONTEXT, max_queued_requests=1,
                            log=lambda msg: None)
    address = server.start("127.0.0.1", 0)
    try:
        first = []
        thread = threading.Thread(target=lambda: first.append(put(address, {"prompts": ["a"], "tokens_to_generate": 1})))
        thread.start()
        assert entered.wait(30)
        status, body = put(address, {"prompts": ["b"], "tokens_to_generate": 1})
        assert status == 429 and "--max-queued-requests" in body["message"]
        release.set()
        thread.join(30)
        assert first[0] == (200, {"text": ["a"], "segments": [["a"]], "logprobs": None})
    finally:
        release.set()
        server.shutdown()
