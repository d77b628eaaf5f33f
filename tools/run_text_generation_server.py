"""Serve a GPT checkpoint over HTTP with Megatron's REST API (`PUT /api`) and a web page at `/`.

    python tools/run_text_generation_server.py --load ckpt --num-layers 24 --hidden-size 1024 \
        --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        [--tensor-model-parallel-size 2 under torchrun] [--host 127.0.0.1] [--port 5000]

Rank 0 serves; the other ranks follow its broadcasts (see megatron/text_generation/server.py). Ctrl-C or SIGTERM
on rank 0 shuts down cleanly and releases the other ranks.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import torch.distributed as dist  # noqa: E402

from megatron.errors import MegatronUserError, exit_on_user_error  # noqa: E402
from megatron.settings import RandomWeightsSettings, TextGenerationServerSettings, add_group  # noqa: E402


class ServerArgsError(MegatronUserError, ValueError):
    """Bad server flags, or the port cannot be bound."""


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's flags (declared in megatron/settings/generation.py)."""
    return add_group(add_group(parser, TextGenerationServerSettings), RandomWeightsSettings)


def check_server_args(args: argparse.Namespace) -> None:
    if not getattr(args, "load", None) and not args.allow_random_weights:
        raise ServerArgsError("no --load: the server would answer with random weights; pass --load CHECKPOINT_DIR "
                              "(a folder written by --save), or --allow-random-weights to serve an untrained model")
    if not 0 <= args.port <= 65535:
        raise ServerArgsError(f"--port {args.port} is not a TCP port; use 0..65535")
    for flag in ("max_tokens_to_generate", "max_prompts", "max_request_bytes", "request_timeout",
                 "max_queued_requests"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ServerArgsError(f"--{flag.replace('_', '-')} must be positive (got {value})")


def _raise_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _agree(error: Optional[str]) -> None:
    """Rank 0 tells every rank whether start-up worked, so no rank waits for a server that never came up."""
    box = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ServerArgsError(box[0])


def main(argv: Optional[List[str]] = None) -> None:
    from megatron.global_vars import get_tokenizer
    from megatron.inference import InferenceEngine, SamplingParams, engine_config_from_args
    from megatron.initialize import initialize_megatron
    from megatron.text_generation import load_model_for_inference
    from megatron.text_generation.server import build_server

    args = initialize_megatron(extra_args_provider=add_server_args, args=argv,
                               args_defaults={"tokenizer_type": "GPT2BPETokenizer", "micro_batch_size": 1,
                                              "no_load_rng": True, "no_load_optim": True})
    check_server_args(args)
    model = load_model_for_inference(args)
    engine_config = engine_config_from_args(args)  # --inference-dynamic-batching: the server on the engine
    engine = InferenceEngine(model, engine_config, eod=int(get_tokenizer().eod)) if engine_config else None
    server = build_server(model, get_tokenizer(), max_sequence_length=args.max_position_embeddings,
                          engine=engine, sampling_params=SamplingParams if engine else None,
                          max_tokens_to_generate=args.max_tokens_to_generate, max_prompts=args.max_prompts,
                          max_batch_tokens=args.max_tokens_to_oom, max_request_bytes=args.max_request_bytes,
                          request_timeout_s=args.request_timeout, max_queued_requests=args.max_queued_requests)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        # Ctrl-C reaches every rank of a terminal job: only rank 0 reacts, then releases the others.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _agree(None)
        server.worker_loop()
        return
    try:
        host, port = server.bind(args.host, args.port)
    except OSError as exc:
        _agree(f"cannot listen on {args.host}:{args.port} ({exc.strerror}); pick another --port or --host")
    _agree(None)
    signal.signal(signal.SIGTERM, _raise_sigterm)
    print(f"> serving text generation on http://{host}:{port}/ (PUT /api, POST /v1/completions, "
          "POST /v1/chat/completions); Ctrl-C to stop", flush=True)
    server.serve_forever()
    print("> server stopped", flush=True)


if __name__ == "__main__":
    exit_on_user_error(main)
