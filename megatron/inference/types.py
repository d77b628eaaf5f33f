"""The inference engine's request-side types: sampling parameters, engine configuration, step outputs, errors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron.errors import MegatronUserError


class RequestRejected(MegatronUserError, ValueError):
    """A request the engine can never run (too long for the cache or the model, bad sampling settings, duplicate id);
    the message is one line naming the limit and the fix."""


@dataclass
class SamplingParams:
    """Per-request generation settings (the static generator's and the OpenAI routes' options).

    `greedy` (or top_k == 1) takes the argmax; otherwise temperature / top-k / top-p sampling from a generator of the
    request's own, seeded with `seed` (-1: random), so a seeded request draws the same tokens alone or batched.
    Generation stops after `max_new_tokens`, or at the first eod (with `stop_on_eod`) or `stop_token_ids` token,
    which is included in the output. `return_logprobs`: the log-probability of each generated token, and with
    `return_prompt_logprobs` those of the prompt tokens 1.. (the static generator's logprobs) in the first output.
    `vocab_size`: ids at and above it (vocabulary padding) are never sampled.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    greedy: bool = False
    seed: int = -1
    stop_token_ids: tuple[int, ...] = ()
    stop_on_eod: bool = True
    return_logprobs: bool = False
    return_prompt_logprobs: bool = False
    vocab_size: Optional[int] = None


@dataclass
class EngineConfig:
    """Engine limits, as Megatron-LM's dynamic inference context takes them (--inference-dynamic-batching-*).

    The KV cache holds `buffer_size_gb` GiB in blocks of `block_size` tokens (or exactly `num_blocks` blocks when
    given: tests); at most `max_requests` requests run at once (None: one per block) and one step feeds at most
    `max_tokens` tokens (decodes first, then prompt tokens). Without `chunked_prefill` a prompt is fed whole in one
    step (so it must fit `max_tokens`); with it a long prompt is split over steps while running requests keep
    decoding. `prefix_caching`: full blocks of identical prompt prefixes are shared between requests.
    """

    buffer_size_gb: float = 40.0
    block_size: int = 256
    max_requests: Optional[int] = None
    max_tokens: int = 16384
    chunked_prefill: bool = False
    prefix_caching: bool = True
    num_blocks: Optional[int] = None


@dataclass
class StepOutput:
    """What one step produced for one request: its new tokens (and their log-probs when asked), and whether it has
    finished ("stop": an eod/stop token, included; "length": max_new_tokens; "cancelled")."""

    request_id: str
    new_tokens: list[int] = field(default_factory=list)
    new_logprobs: Optional[list[float]] = None
    finished: bool = False
    finish_reason: Optional[str] = None
    prompt_logprobs: Optional[list[float]] = None


@dataclass
class EngineStats:
    """Counts for backpressure: requests waiting and running, blocks free (evictable prefix blocks included); blocks in
    the prefix cache, steps run, and blocks taken from the prefix cache instead of computed."""

    queued: int
    running: int
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    steps: int
    prefix_hit_blocks: int
