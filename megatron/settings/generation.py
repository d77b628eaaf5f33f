"""The settings tools/generate_samples_gpt.py and tools/run_text_generation_server.py add to Megatron's (and the
random-weights opt-in tasks/main.py and tasks/eval_harness/evaluate.py add too)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from megatron.settings.declare import setting


@dataclasses.dataclass
class TextGenerationSettings:
    """--help group "text generation"."""

    TITLE: ClassVar[str] = "text generation"
    temperature: float = setting("--temperature", default=1.0,
        help="Sampling temperature; 0 means greedy decoding (as the REST server).",
        read_by="tools/generate_samples_gpt.py")
    greedy: bool = setting("--greedy", default=False, help="Greedy decoding (same as --top_k 1).",
        read_by="tools/generate_samples_gpt.py")
    top_p: float = setting("--top_p", default=0.0, help="Top-p (nucleus) sampling; 0 = off.",
        read_by="tools/generate_samples_gpt.py")
    top_k: int = setting("--top_k", default=0, help="Top-k sampling; 0 = off.", read_by="tools/generate_samples_gpt.py")
    out_seq_length: int = setting("--out-seq-length", default=1024, help="Tokens to generate (capped by --seq-length).",
        read_by="tools/generate_samples_gpt.py")
    sample_input_file: Optional[str] = setting("--sample-input-file", help="Prompts, one per line.",
        read_by="tools/generate_samples_gpt.py")
    sample_output_file: Optional[str] = setting("--sample-output-file", "--genfile",
        help="JSON-lines output (default: <input>.out, or stdout for unconditional samples).",
        read_by="tools/generate_samples_gpt.py")
    num_samples: int = setting("--num-samples", default=0, help="Unconditional samples (when no input file).",
        read_by="tools/generate_samples_gpt.py")
    recompute: bool = setting("--recompute", default=False,
        help="Recompute the whole prefix each step instead of using the KV cache.",
        read_by="tools/generate_samples_gpt.py")


@dataclasses.dataclass
class TextGenerationServerSettings:
    """--help group "text generation server"."""

    TITLE: ClassVar[str] = "text generation server"
    host: str = setting("--host", default="127.0.0.1", help="Address to bind (0.0.0.0: all interfaces).",
        read_by="tools/run_text_generation_server.py")
    port: int = setting("--port", default=5000, help="TCP port (0: any free port).",
        read_by="tools/run_text_generation_server.py")
    max_tokens_to_generate: Optional[int] = setting("--max-tokens-to-generate",
        help="Largest tokens_to_generate a request may ask for (default: the context length).",
        read_by="tools/run_text_generation_server.py")
    max_prompts: int = setting("--max-prompts", default=128, help="Most prompts in one request.",
        read_by="tools/run_text_generation_server.py")
    max_request_bytes: int = setting("--max-request-bytes", default=1048576,
        help="Largest request body (else HTTP 413).", read_by="tools/run_text_generation_server.py")
    request_timeout: float = setting("--request-timeout", default=300.0,
        help="Seconds a request may wait for its turn (else HTTP 503) and a client may stall mid-request.",
        read_by="tools/run_text_generation_server.py")
    max_queued_requests: Optional[int] = setting("--max-queued-requests",
        help="Most prompts the server holds at once, waiting or generating (else HTTP 429 with Retry-After); "
             "default: no limit.", read_by="tools/run_text_generation_server.py")


@dataclasses.dataclass
class RandomWeightsSettings:
    """--help group "random weights": the one opt-in of the server, generation and evaluation for running without
    --load (they refuse otherwise)."""

    TITLE: ClassVar[str] = "random weights"
    allow_random_weights: bool = setting("--allow-random-weights", default=False,
        help="Run without --load on an untrained, randomly initialised model (serving, generation, evaluation); "
             "refused otherwise.", read_by="tools/run_text_generation_server.py")
