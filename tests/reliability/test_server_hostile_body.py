"""A hostile request body cannot freeze the REST server (issue 30, must-fix 1).

The JSON depth check that runs before parsing used to be a regular expression whose cost grew with the square of a
body made of one unclosed string full of `\\"` (a 30 KB body froze `/api` for 18 s). It is now a fixed number of
linear passes: its counted work grows in proportion to the body, it agrees with the parser on what the depth is, and
a good request sent while hostile 1 MB bodies are being checked is answered promptly.
"""
from __future__ import annotations

import json
import random
import threading
import time

from megatron.text_generation.http_limits import json_depth
from megatron.text_generation.server import build_server
from tests.text_generation.test_server_http import call, put, tiny_gpt, tiny_tokenizer


def _hostile(size: int) -> bytes:
    """One unclosed string full of escaped quotes: the body that made the old check quadratic."""
    return b'{"prompts": ["' + b'\\"' * (size // 2)


def _parsed_depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_parsed_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_parsed_depth(v) for v in value.values()), default=0)
    return 0


def test_json_depth_check_work_is_linear_in_the_body() -> None:
    for make in (_hostile, lambda size: b"[" * size, lambda size: b'["a\\\\"],' * (size // 8)):
        small, large = [], []
        json_depth(make(10_000), small)
        json_depth(make(100_000), large)
        assert 9.0 <= large[0] / small[0] <= 11.0, (small, large)  # 10x the body, 10x the work (quadratic: 100x)
        assert large[0] <= 16 * 100_000


def test_json_depth_check_time_grows_linearly() -> None:
    """Coarse companion of the counted-work test: CPU time, best of 3, 10 KB vs 100 KB (quadratic would be ~100x)."""
    def best(body: bytes) -> float:
        times = []
        for _ in range(3):
            start = time.process_time()
            json_depth(body)
            times.append(time.process_time() - start)
        return max(min(times), 1e-4)

    assert best(_hostile(100_000)) / best(_hostile(10_000)) < 40


def test_json_depth_agrees_with_the_parser_on_strings_and_escapes() -> None:
    rng = random.Random(0)
    leaves = ['x\\"[', "\\\\", "]}{", '"', "\\", 'ab"c\\\\"[', 1, None, "[[[[", "}}"]

    def value(depth: int) -> object:
        r = rng.random()
        if depth > 7 or r < 0.3:
            return rng.choice(leaves)
        if r < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {f"k{i}{rng.choice(leaves)}": value(depth + 1) for i in range(rng.randint(0, 3))}

    for _ in range(1000):
        text = json.dumps(value(0))
        assert json_depth(text.encode()) == _parsed_depth(json.loads(text)), text
    assert json_depth(b"") == 0 and json_depth(b'"[[["') == 0 and json_depth(b'["\\\\", [[]]]') == 3


def test_hostile_body_does_not_stall_other_clients(shared_data) -> None:
    server = build_server(tiny_gpt(), tiny_tokenizer(shared_data), max_sequence_length=64, log=lambda msg: None)
    address = server.start()
    hostile_answers: list[int] = []

    def attacker(path: str) -> None:
        for _ in range(2):
            status, _ = call(address, "PUT" if path == "/api" else "POST", path, _hostile(server.max_request_bytes - 64),
                             {"Content-Type": "application/json"})
            hostile_answers.append(status)

    attackers = [threading.Thread(target=attacker, args=(p,)) for p in ("/api", "/v1/completions")]
    try:
        for t in attackers:
            t.start()
        start = time.monotonic()
        status, body = put(address, {"prompts": ["good request"], "tokens_to_generate": 2, "no_log": True})
        elapsed = time.monotonic() - start
        for t in attackers:
            t.join(120)
    finally:
        server.shutdown()
    assert status == 200 and body["text"][0].startswith("good request"), body
    assert elapsed < 15.0, f"the good request waited {elapsed:.1f} s behind hostile bodies"  # was minutes to hours
    assert sorted(hostile_answers) == [400] * 4  # not valid JSON: a 400, after a linear check
