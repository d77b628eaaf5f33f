"""The REST server and clients that misbehave without malice: a streaming client that never reads must not hold up
anyone else (the generation lock is never held while writing to a socket; the stalled stream is dropped after the
stall timeout), and a server started with no --load refuses to serve random weights unless --allow-random-weights."""
from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from megatron.text_generation.server import build_server
from megatron.text_generation.stream_writer import StreamWriter
from tests.reliability.helpers import MODEL, assert_one_line_error, run
from tests.text_generation.test_server_http import CONTEXT, tiny_gpt, tiny_tokenizer

MODEL_NAME = "m" * 3000  # every streamed event echoes it: megabytes, more than the socket buffers hold


def _stalled_stream_request(address) -> socket.socket:
    """POST a streaming completion of 48 prompts x 56 tokens (~8 MB of events) and never read the answer."""
    body = json.dumps({"model": MODEL_NAME, "prompt": [f"prompt {i}" for i in range(48)], "max_tokens": 56,
                       "temperature": 0, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_streaming_client_that_never_reads_does_not_block_others(shared_data) -> None:
    logs: list[str] = []
    server = build_server(tiny_gpt(), tiny_tokenizer(shared_data), max_sequence_length=CONTEXT, max_prompts=64,
                          request_timeout_s=90, log=logs.append)  # a stalled write waits up to 90 s
    address = server.start()
    stalled = _stalled_stream_request(address)
    try:
        while not any("openai completion (stream)" in line for line in logs):
            time.sleep(0.01)  # the stalled request has the lock and is generating
        # Waits for that generation only, not for the stalled client (which would take 90 s: past this timeout).
        conn = http.client.HTTPConnection(*address, timeout=30)
        conn.request("PUT", "/api", body=json.dumps({"prompts": ["Hello"], "tokens_to_generate": 2}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read())["text"][0].startswith("Hello")
        conn.close()
        assert not server.lock.locked()
        assert not any("dropped" in line for line in logs)  # answered while the stalled stream still waits
        assert stalled.recv(1 << 16).split(b"\r\n")[0].endswith(b" 200 OK")  # the stream had started, unread
    finally:
        stalled.close()
        server.shutdown()


def test_stream_writer_drops_a_client_that_stops_reading() -> None:
    logs: list[str] = []
    ours, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    writer = StreamWriter(ours.makefile("wb", buffering=0), ours, 0.5, logs.append, "test client")
    try:
        started = time.monotonic()
        for _ in range(20000):  # 20 MB: far beyond the buffers
            writer.put(b"x" * 1000)
        assert time.monotonic() - started < 5.0  # put() never waits for the client
        writer.close()
        assert writer.broken and logs == ["server: stream to test client dropped: it read nothing for 0.5 s"]
    finally:
        ours.close()
        theirs.close()


@pytest.mark.slow
def test_server_without_load_refuses_random_weights(tiny_data: dict, tmp_path) -> None:
    proc = run("tools/run_text_generation_server.py", *MODEL, *tiny_data["tokenizer"], "--port", "0", cwd=tmp_path)
    assert_one_line_error(proc, "no --load", "random weights", "--allow-random-weights")


def test_allow_random_weights_is_registered() -> None:
    import argparse

    from megatron.settings.flag_registry import RUNTIME_SETTINGS
    from tools.run_text_generation_server import add_server_args, check_server_args

    args = add_server_args(argparse.ArgumentParser()).parse_args(["--allow-random-weights"])
    args.load = None
    check_server_args(args)  # accepted: no error
    assert RUNTIME_SETTINGS["allow_random_weights"] == "tools/run_text_generation_server.py"
