"""The REST server under load and abuse: 50 concurrent clients x 4 requests to 127.0.0.1 are all answered (a listen
backlog of 128 instead of the standard library's 5, so no connection is reset), JSON nested beyond 32 levels is a 400
before parsing (no RecursionError), and a request that cannot get its turn within the request timeout is a 503."""
from __future__ import annotations

import http.client
import json
import threading
import time

from megatron.text_generation.server import MAX_JSON_DEPTH, MegatronServer, build_server
from tests.text_generation.test_server_http import put, tiny_gpt, tiny_tokenizer

CLIENTS, REQUESTS = 50, 4


def test_fifty_concurrent_clients_all_answered(shared_data) -> None:
    server = build_server(tiny_gpt(), tiny_tokenizer(shared_data), max_sequence_length=64, log=lambda msg: None)
    address = server.start()
    statuses: list[int] = []
    errors: list[str] = []
    barrier = threading.Barrier(CLIENTS)

    def client(i: int) -> None:
        barrier.wait()  # all connect at once
        for j in range(REQUESTS):
            try:
                status, body = put(address, {"prompts": [f"client {i} request {j}"], "tokens_to_generate": 2,
                                             "no_log": True})
                statuses.append(status)
                if status != 200 or not body["text"][0].startswith(f"client {i} request {j}"):
                    errors.append(f"{i}/{j}: {status} {body}")
            except Exception as exc:  # noqa: BLE001 - a reset connection is the failure this test looks for
                errors.append(f"{i}/{j}: {exc!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    start = time.time()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        server.shutdown()
    assert errors == [] and statuses.count(200) == CLIENTS * REQUESTS, (errors[:5], len(statuses))
    print(f"{CLIENTS * REQUESTS} requests from {CLIENTS} concurrent clients answered in {time.time() - start:.1f} s")


def _raw_put(address, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*address, timeout=60)
    try:
        conn.request("PUT", "/api", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_deep_json_is_400_and_slow_turn_is_503() -> None:
    release = threading.Event()

    def generate(prompts, tokens_to_generate, **options):
        release.wait(30)  # holds the one-request-at-a-time lock
        return {"text": prompts, "segments": None}

    server = MegatronServer(generate, lambda text: len(text.split()), max_sequence_length=64,
                            request_timeout_s=0.5, log=lambda msg: None)
    address = server.start()
    try:
        status, body = _raw_put(address, b'{"prompts": ' + b"[" * 100000 + b"]" * 100000 + b"}")
        assert status == 400 and f"deeper than {MAX_JSON_DEPTH} levels" in body["message"]
        status, body = _raw_put(address, b'{"prompts": ["a"], "x": ' + b"[" * 30 + b"]" * 30 + b"}")
        assert status == 400 and "deeper" not in body["message"]  # shallow enough: the normal validation answers
        first: dict = {}
        holder = threading.Thread(target=lambda: first.update(r=put(address, {"prompts": ["a"],
                                                                              "tokens_to_generate": 1})))
        holder.start()
        while not server.lock.locked():
            time.sleep(0.01)
        status, body = put(address, {"prompts": ["b"], "tokens_to_generate": 1})
        assert status == 503 and "--request-timeout" in body["message"], body
        release.set()
        holder.join(30)
        assert first["r"][0] == 200
    finally:
        release.set()
        server.shutdown()
