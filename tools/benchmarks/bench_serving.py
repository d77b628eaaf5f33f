"""Serving benchmark and load tool: N concurrent clients against the text-generation server (standard-library HTTP
and threads, bounded in request count and time).

`load_test` sends each request body once from `concurrency` client threads (streamed `POST /v1/completions` with
usage, or `PUT /api`) and records per request: HTTP status, latency, time to the first streamed event (TTFT), output
tokens and the answer; `summarize` gives output tokens/s, p50/p99 latency and TTFT. The benchmark (`main`) serves a
random-weight GPT with the tiny GPT-2 tokenizer in this process, today's one-at-a-time server and, with
`--engine`, the same server on the inference engine (both started side by side and measured in turn at each point,
wall and process CPU time), at 1, 4 and 16 clients, and times Hugging Face `generate` on static batches of the same
requests:

    python tools/benchmarks/bench_serving.py [--clients 1 4 16 --requests 32 --max-tokens 32 --layers 4
        --hidden 256 --engine --json out.json]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import sys
import threading
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

COMPLETIONS = "/v1/completions"


def percentile(values: list[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100, nearest rank) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(round(q / 100.0 * len(ordered) + 0.5))))
    return ordered[rank - 1]


def _read_stream(response: http.client.HTTPResponse, started: float) -> dict:
    """Parse server-sent completion events: text per choice, usage, TTFT (first event), errors."""
    texts: dict[int, str] = {}
    finish: dict[int, Optional[str]] = {}
    result: dict[str, Any] = {"ttft_s": None, "usage": None, "error": None}
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data: "):
            continue
        if result["ttft_s"] is None:
            result["ttft_s"] = time.perf_counter() - started
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if "error" in obj:
            result["error"] = obj["error"]
        if obj.get("usage"):
            result["usage"] = obj["usage"]
        for choice in obj.get("choices", []):
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice.get("finish_reason"):
                finish[choice["index"]] = choice["finish_reason"]
    result["texts"] = [texts[i] for i in sorted(texts)]
    result["finish_reasons"] = [finish.get(i) for i in sorted(texts)]
    return result


def one_request(address: tuple[str, int], body: dict, path: str = COMPLETIONS, timeout_s: float = 120.0) -> dict:
    """Send one request; {"status", "latency_s", "ttft_s", "output_tokens", "answer", "retry_after"}.

    A `stream: true` completion is read event by event (TTFT = first event); other answers are read whole (TTFT =
    latency). `answer` is the decoded JSON (or, streamed, {"texts", "finish_reasons", "usage", "error"})."""
    conn = http.client.HTTPConnection(*address, timeout=timeout_s)
    started = time.perf_counter()
    try:
        conn.request("PUT" if path == "/api" else "POST", path, body=json.dumps(body).encode("utf-8"),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        retry_after = response.getheader("Retry-After")
        if response.status == 200 and body.get("stream"):
            answer = _read_stream(response, started)
            ttft = answer.pop("ttft_s")
            tokens = (answer["usage"] or {}).get("completion_tokens")
        else:
            answer = json.loads(response.read().decode("utf-8") or "null")
            ttft = None
            tokens = (answer.get("usage") or {}).get("completion_tokens") if isinstance(answer, dict) else None
        latency = time.perf_counter() - started
        return {"status": response.status, "latency_s": latency, "ttft_s": ttft if ttft is not None else latency,
                "output_tokens": tokens, "answer": answer, "retry_after": retry_after}
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return {"status": None, "latency_s": time.perf_counter() - started, "ttft_s": None, "output_tokens": None,
                "answer": {"error": repr(exc)}, "retry_after": None}
    finally:
        conn.close()


def load_test(address: tuple[str, int], bodies: list[dict], concurrency: int, *, path: str = COMPLETIONS,
              timeout_s: float = 120.0, deadline_s: float = 600.0) -> tuple[list[Optional[dict]], float]:
    """Each body sent once by `concurrency` client threads; (per-body results in order, wall seconds).

    Bounded: each request by `timeout_s`, the whole run by `deadline_s` (bodies not started by then stay None)."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for item in enumerate(bodies):
        todo.put(item)
    results: list[Optional[dict]] = [None] * len(bodies)
    started = time.perf_counter()

    def client() -> None:
        while time.perf_counter() - started < deadline_s:
            try:
                i, body = todo.get_nowait()
            except queue.Empty:
                return
            results[i] = one_request(address, body, path, timeout_s)

    threads = [threading.Thread(target=client, name=f"load-client-{k}", daemon=True)
               for k in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s + timeout_s)
    return results, time.perf_counter() - started


def summarize(results: list[Optional[dict]], wall_s: float) -> dict:
    """Output tokens/s over the wall time, latency and TTFT percentiles (seconds), counts of answered requests."""
    done = [r for r in results if r is not None and r["status"] == 200]
    tokens = sum(r["output_tokens"] or 0 for r in done)
    latencies = [r["latency_s"] for r in done]
    ttfts = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
    return {"requests": len(results), "ok": len(done), "output_tokens": tokens, "wall_s": wall_s,
            "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


def completion_bodies(prompts: list[list[int]], max_tokens: int, stream: bool = True) -> list[dict]:
    """Greedy streamed completions of token-id prompts, exactly `max_tokens` each (eod is left to the model)."""
    return [{"prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
             **({"stream_options": {"include_usage": True}} if stream else {})} for p in prompts]


def _build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The random-weight GPT, the tiny GPT-2 tokenizer and the same weights as a Hugging Face GPT2LMHeadModel."""
    import transformers

    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.core.transformer_config import TransformerConfig
    from megatron.models.gpt.hf_gpt2 import hf_gpt2_config_kwargs, megatron_gpt_to_hf_state_dict
    from megatron.models.gpt.model import GPTModel
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

    data = os.path.join(args.data, "openwebtext-1000")
    tokenizer = GPT2BPETokenizer(os.path.join(data, "gpt2-tiny-vocab.json"), os.path.join(data, "gpt2-tiny-merges.txt"))
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               padded_vocab_size=5120, max_position_embeddings=args.context, hidden_dropout=0.0,
                               attention_dropout=0.0, init_method_std=0.2, layernorm_epsilon=1e-5)
    model_parallel_manual_seed(1234)
    model = GPTModel(config, parallel_output=False).eval()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_gpt2_config_kwargs(config))).eval()
    hf.load_state_dict(megatron_gpt_to_hf_state_dict(model.state_dict_for_save_checkpoint(), config), strict=False)
    return model, tokenizer, hf


def _prompts(args: argparse.Namespace, n: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)  # equal lengths: HF's static batches need no padding
    return torch.randint(0, 4990, (n, args.prompt), generator=g).tolist()


def _measure(servers: dict[str, Any], args: argparse.Namespace) -> dict[str, dict]:
    """Each client count against every server in turn (alternating which goes first, so that both see the same
    machine load): the summary plus the process CPU seconds (server and clients share this process)."""
    out: dict[str, dict] = {name: {} for name in servers}
    names = list(servers)
    for k, clients in enumerate(args.clients):
        n = max(args.requests, clients)
        for name in (names if k % 2 == 0 else list(reversed(names))):
            cpu = time.process_time()
            results, wall = load_test(servers[name], completion_bodies(_prompts(args, n), args.max_tokens), clients,
                                      deadline_s=args.deadline)
            point = summarize(results, wall)
            point["cpu_s"] = time.process_time() - cpu
            point["output_tokens_per_cpu_s"] = point["output_tokens"] / max(point["cpu_s"], 1e-9)
            point["texts"] = [r["answer"].get("texts") if r else None for r in results]
            out[name][str(clients)] = point
            print(f"  ({name}, {clients} clients: {point['output_tokens_per_s']:.1f} tok/s, "
                  f"{point['output_tokens_per_cpu_s']:.1f} tok/CPU-s)", file=sys.stderr, flush=True)
    return out


def _serve_and_measure(model: Any, tokenizer: Any, args: argparse.Namespace, engine: Any, params: Any) -> dict:
    """Today's server and (with `engine`) the server on the engine, started side by side and measured in turn."""
    from megatron.text_generation.server import build_server

    servers = {"static_server": build_server(model, tokenizer, max_sequence_length=args.context,
                                             log=lambda msg: None, max_prompts=256)}
    if engine is not None:
        servers["engine_server"] = build_server(model, tokenizer, max_sequence_length=args.context,
                                                log=lambda msg: None, max_prompts=256, engine=engine,
                                                sampling_params=params)
    addresses = {name: server.start("127.0.0.1", 0) for name, server in servers.items()}
    try:
        for address in addresses.values():
            one_request(address, completion_bodies(_prompts(args, 1), 4)[0])  # warm-up
        return _measure(addresses, args)
    finally:
        for server in servers.values():
            server.shutdown()


def _hf_static(hf: Any, args: argparse.Namespace) -> dict:
    """HF generate on static batches of `clients` of the same requests: output tokens/s at each client count."""
    import torch

    out = {}
    with torch.no_grad():
        hf.generate(torch.tensor(_prompts(args, 1)), max_new_tokens=2, do_sample=False, pad_token_id=0)
        for clients in args.clients:
            prompts = torch.tensor(_prompts(args, max(args.requests, clients)))
            started = time.perf_counter()
            for i in range(0, prompts.size(0), clients):
                batch = prompts[i:i + clients]
                hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.max_tokens,
                            min_new_tokens=args.max_tokens, do_sample=False, use_cache=True, eos_token_id=None,
                            pad_token_id=0)
            wall = time.perf_counter() - started
            out[str(clients)] = {"output_tokens_per_s": prompts.size(0) * args.max_tokens / wall, "wall_s": wall}
    return out


def engine_for(model: Any, tokenizer: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    """The inference engine on `model` and its SamplingParams type (megatron/inference)."""
    from megatron import inference

    config = inference.EngineConfig(**json.loads(args.engine_config))
    return inference.InferenceEngine(model, config, eod=int(tokenizer.eod)), inference.SamplingParams


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per client count (at least the clients)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--engine", action="store_true", help="also the server on the inference engine")
    p.add_argument("--engine-config", default='{"buffer_size_gb": 0.05, "block_size": 16}',
                   help="EngineConfig fields as JSON")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate")
    p.add_argument("--deadline", type=float, default=900.0, help="seconds one client count may take")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", default=os.environ.get("SHARED_DATA", "/work/shared/data"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, hf = _build(args)
    result: dict[str, Any] = {"config": vars(args), "threads": torch.get_num_threads()}
    engine, params = engine_for(model, tokenizer, args) if args.engine else (None, None)
    result.update(_serve_and_measure(model, tokenizer, args, engine, params))
    if not args.no_hf:
        result["hf_static_batches"] = _hf_static(hf, args)
    _report(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _report(result: dict, args: argparse.Namespace) -> None:
    print(f"serving: {args.layers} layers, hidden {args.hidden}, prompt {args.prompt}, {args.max_tokens} new tokens, "
          f"{args.requests} requests per point, {result['threads']} threads")
    for name in ("static_server", "engine_server"):
        for clients, s in result.get(name, {}).items():
            print(f"  {name:14s} {clients:>3s} clients: {s['output_tokens_per_s']:8.1f} tok/s "
                  f"({s['output_tokens_per_cpu_s']:.1f} per CPU-s), latency p50 "
                  f"{s['latency_p50_s']:.2f} s p99 {s['latency_p99_s']:.2f} s, TTFT p50 {s['ttft_p50_s']:.2f} s "
                  f"p99 {s['ttft_p99_s']:.2f} s ({s['ok']}/{s['requests']} ok)")
    if "engine_server" in result:
        for clients in result["engine_server"]:
            ratio = (result["engine_server"][clients]["output_tokens_per_s"]
                     / result["static_server"][clients]["output_tokens_per_s"])
            same = result["engine_server"][clients]["texts"] == result["static_server"][clients]["texts"]
            cpu_ratio = (result["engine_server"][clients]["output_tokens_per_cpu_s"]
                         / result["static_server"][clients]["output_tokens_per_cpu_s"])
            print(f"  engine / static at {clients} clients: {ratio:.2f}x wall, {cpu_ratio:.2f}x CPU time, "
                  f"identical greedy texts: {same}")
    for clients, s in result.get("hf_static_batches", {}).items():
        print(f"  HF generate, static batches of {clients:>3s}: {s['output_tokens_per_s']:8.1f} tok/s")


if __name__ == "__main__":
    main()
