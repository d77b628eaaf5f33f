"""Prompt loop against a running text-generation server: `python tools/text_generation_cli.py localhost:5000`.

Reads one prompt per line from stdin (Ctrl-D ends), sends it to `PUT http://HOST:PORT/api` and prints the
completion. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import List, Optional


def request_completion(url: str, prompt: str, tokens_to_generate: int, **options: object) -> dict:
    """PUT one request; returns the JSON answer or raises RuntimeError with the server's message."""
    body = json.dumps({"prompts": [prompt], "tokens_to_generate": tokens_to_generate, **options}).encode("utf-8")
    req = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as response:
            return json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read().decode("utf-8")).get("message", exc.reason)
        except ValueError:
            message = exc.reason
        raise RuntimeError(f"server answered {exc.code}: {message}") from None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT of tools/run_text_generation_server.py")
    parser.add_argument("--tokens-to-generate", type=int, default=64,
                        help="Tokens to generate per prompt (default: 64; the server may cap it).")
    parser.add_argument("--temperature", type=float, default=None,
                        help="Sampling temperature in [0, 100]; 0 means greedy (default: the server's, 1.0).")
    parser.add_argument("--top-k", type=int, default=None,
                        help="Sample from the k most likely tokens; 0 = off (default: the server's, 0).")
    parser.add_argument("--top-p", type=float, default=None,
                        help="Nucleus sampling probability in [0, 1]; 0 = off (default: the server's, 0).")
    args = parser.parse_args(argv)
    address = args.address if "://" in args.address else f"http://{args.address}"
    url = address.rstrip("/") + "/api"
    options = {k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p))
               if v is not None}
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("Enter prompt: ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        prompt = line.rstrip("\n")
        try:
            answer = request_completion(url, prompt, args.tokens_to_generate, **options)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            continue
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            print(f"error: cannot reach the server at {url} ({reason}); is it running?", file=sys.stderr)
            return 1
        print(answer["text"][0], flush=True)


if __name__ == "__main__":
    sys.exit(main())
