"""The REST server over real HTTP with a tiny random-weight GPT (2 layers) and the tiny GPT-2 BPE tokenizer:
good requests, every kind of bad request (400/413 with a JSON message, server still answering), curl, the prompt-loop
CLI and the web page in headless Chromium."""
from __future__ import annotations

import html
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.parse

import pytest

from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer_config import TransformerConfig
from megatron.models.gpt.model import GPTModel
from megatron.text_generation import generate
from megatron.text_generation.server import build_server
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

CONTEXT = 64
CHROMIUM = "/usr/bin/chromium"


def tiny_gpt(tp: int = 1, tp_rank: int = 0, context: int = CONTEXT, **kwargs) -> GPTModel:
    """2-layer GPT with room for the 5,000-token tiny GPT-2 vocabulary (padded to 5,120), `context` positions."""
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=5120,
                               max_position_embeddings=context, hidden_dropout=0.0, attention_dropout=0.0,
                               init_method_std=0.2, tensor_model_parallel_size=tp)
    model_parallel_manual_seed(1234, tp_rank)
    return GPTModel(config, parallel_output=False, **kwargs).eval()


def tiny_tokenizer(shared_data) -> GPT2BPETokenizer:
    d = shared_data / "openwebtext-1000"
    return GPT2BPETokenizer(str(d / "gpt2-tiny-vocab.json"), str(d / "gpt2-tiny-merges.txt"))


def call(address, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """One HTTP request; returns (status, decoded JSON or text)."""
    conn = http.client.HTTPConnection(*address, timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        raw = response.read().decode("utf-8")
        is_json = response.getheader("Content-Type", "").startswith("application/json")
        return response.status, json.loads(raw) if is_json else raw
    finally:
        conn.close()


def post(address, payload, path: str = "/v1/completions") -> tuple[int, object]:
    """POST a JSON payload (or raw bytes) to `path`; returns (status, decoded JSON or text)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8")
    return call(address, "POST", path, body, {"Content-Type": "application/json"})


def openai_served(model, tokenizer):
    """Generator for a module fixture: the server on `model` started on a free port, yielding (address, model,
    tokenizer, openai client); shut down afterwards."""
    import openai

    server = build_server(model, tokenizer, max_sequence_length=CONTEXT, max_tokens_to_generate=32, max_prompts=4,
                          max_request_bytes=4096, log=lambda msg: None)
    address = server.start("127.0.0.1", 0)
    client = openai.OpenAI(base_url=f"http://{address[0]}:{address[1]}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    yield address, model, tokenizer, client
    server.shutdown()


def put(address, payload) -> tuple[int, object]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8")
    return call(address, "PUT", "/api", body, {"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def served(shared_data):
    model, tokenizer = tiny_gpt(), tiny_tokenizer(shared_data)
    logs: list[str] = []
    server = build_server(model, tokenizer, max_sequence_length=CONTEXT, max_tokens_to_generate=32,
                          max_prompts=4, max_request_bytes=4096, log=logs.append)
    address = server.start("127.0.0.1", 0)
    yield address, model, tokenizer, logs
    server.shutdown()


def test_good_request_returns_megatron_fields(served):
    address, model, tokenizer, _ = served
    prompts = ["The quick brown fox", "Hello"]
    status, body = put(address, {"prompts": prompts, "tokens_to_generate": 6, "temperature": 0, "logprobs": True})
    assert status == 200, body
    assert set(body) == {"text", "segments", "logprobs"}
    # greedy: exactly what generate() gives in-process
    ref = generate(model, tokenizer, prompts, 6, greedy=True, return_output_log_probs=True)
    assert body["text"] == ref["text"] and body["segments"] == ref["segments"]
    for text, prompt, segments, logprobs in zip(body["text"], prompts, body["segments"], body["logprobs"]):
        assert text.startswith(prompt) and "".join(segments) == text
        assert len(logprobs) == len(segments) - 1 and all(lp <= 0 for lp in logprobs)
    # sampling with a seed is reproducible; logprobs are left out unless asked for
    runs = [put(address, {"prompts": ["Hello"], "tokens_to_generate": 8, "top_k": 5, "random_seed": 11})
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] == 200 and runs[0][1]["logprobs"] is None


BAD_BODIES = [
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    ({"prompts": []}, 400, "prompts is empty"),
    ({"prompts": "Hello"}, 400, "list of strings"),
    ({"prompts": ["Hello"], "tokens_to_generate": "ten"}, 400, "tokens_to_generate must be a number"),
    ({"prompts": ["Hello"], "tokens_to_generate": 33}, 400, "--max-tokens-to-generate"),
    ({"prompts": ["word " * 60], "tokens_to_generate": 8}, 400, "context of 64 tokens"),
    ({"prompts": ["Hello"], "temperature": -1}, 400, "temperature"),
    ({"prompts": ["Hello"], "top_p": 2}, 400, "top_p"),
    ({"prompts": ["Hello"], "top_k": 3, "top_p": 0.5}, 400, "not both"),
    ({"prompts": ["Hello"], "nonsense": 1}, 400, "unknown field(s) nonsense"),
    ({"prompts": ["Hello"] * 5}, 400, "too many prompts"),
    ({"prompts": ["x" * 5000]}, 413, "--max-request-bytes"),
]


@pytest.mark.parametrize("payload,status,message", BAD_BODIES, ids=[m for _, _, m in BAD_BODIES])
def test_bad_request_gets_json_error_and_server_keeps_answering(served, payload, status, message):
    address = served[0]
    got, body = put(address, payload)
    assert got == status and message in body["message"], body
    assert put(address, {"prompts": ["Hello"], "tokens_to_generate": 2})[0] == 200


def test_other_methods_and_paths(served):
    address = served[0]
    status, body = call(address, "PUT", "/api", b'{"prompts": ["a"]}')  # http.client adds Content-Length
    assert status == 200
    conn = http.client.HTTPConnection(*address, timeout=60)  # no Content-Length at all
    conn.putrequest("PUT", "/api")
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 411 and "Content-Length" in json.loads(response.read())["message"]
    conn.close()
    assert call(address, "GET", "/api")[0] == 405
    assert call(address, "GET", "/nothing")[0] == 404
    status, page = call(address, "GET", "/")
    assert status == 200 and 'id="prompt"' in page and "http://" not in page and "https://" not in page


def test_curl_request(served):
    address = served[0]
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    out = subprocess.run(["curl", "-s", "-X", "PUT", f"http://{address[0]}:{address[1]}/api",
                          "-H", "Content-Type: application/json; charset=UTF-8",
                          "-d", '{"prompts": ["Once upon a time"], "tokens_to_generate": 4}'],
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout)["text"][0].startswith("Once upon a time")


def test_cli_prompt_loop(served, repo_root):
    address = served[0]
    cli = [sys.executable, str(repo_root / "tools" / "text_generation_cli.py"), f"{address[0]}:{address[1]}",
           "--tokens-to-generate", "3"]
    out = subprocess.run(cli, input="The cat\n" + "w " * 70 + "\nA dog\n", capture_output=True, text=True,
                         timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stderr
    assert len(lines) == 2 and lines[0].startswith("The cat") and lines[1].startswith("A dog")
    assert "error: server answered 400" in out.stderr and "context" in out.stderr
    down = subprocess.run(cli[:2] + ["127.0.0.1:1"], input="hi\n", capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "cannot reach the server" in down.stderr


def _chromium_dom(address, query: dict) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=30000", "--dump-dom",
             f"http://{address[0]}:{address[1]}/?{urllib.parse.urlencode(query)}"],
            capture_output=True, text=True, timeout=180)
    return out.stdout, out.stderr


def _output_div(dom: str) -> tuple[str, str]:
    """(data-state, shown text) of the page's #output element."""
    start = dom.index('id="output"')
    tag = dom[dom.rindex("<div", 0, start): dom.index(">", start)]
    state = tag.split('data-state="', 1)[1].split('"', 1)[0]
    return state, html.unescape(dom[dom.index(">", start) + 1: dom.index("</div>", start)])


def test_web_page_in_headless_chromium(served):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} not found (apt-get install -y chromium)")
    address = served[0]
    dom, err = _chromium_dom(address, {"prompt": "In the beginning", "tokens": "5", "autorun": "1"})
    state, shown = _output_div(dom)
    assert state == "done", (dom[-2000:], err[-2000:])
    assert shown.startswith("In the beginning") and len(shown) > len("In the beginning")
    # a refused request is shown as the server's message
    dom, err = _chromium_dom(address, {"prompt": "In the beginning", "tokens": "99", "autorun": "1"})
    assert _output_div(dom) == ("error", "error: tokens_to_generate=99 exceeds this server's limit of 32 "
                                         "(--max-tokens-to-generate)"), err[-2000:]
