"""Drivers for the inference-engine tests: run requests through an engine arriving at given steps, and the static
generator's answer for one prompt."""
from __future__ import annotations

import random
from typing import Optional

import torch

from megatron.inference import EngineConfig, InferenceEngine, SamplingParams
from megatron.text_generation.generation import generate_tokens

EOD = 63  # tests/model/helpers.VOCAB - 1


def random_prompts(count: int, vocab: int, seed: int, shared_prefix: int = 9, max_len: int = 20) -> list[list[int]]:
    """`count` prompts of 1..max_len tokens; every third one starts with the same `shared_prefix` tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab - 1) for _ in range(shared_prefix)]
    prompts = []
    for i in range(count):
        body = [rng.randrange(vocab - 1) for _ in range(rng.randint(1, max_len - shared_prefix))]
        prompts.append(prefix + body if i % 3 == 0 else [rng.randrange(vocab - 1)] + body)
    return prompts


def run(model: torch.nn.Module, prompts: list[list[int]], config: EngineConfig, params: SamplingParams,
        arrivals: Optional[list[int]] = None, engine: Optional[InferenceEngine] = None) -> tuple[dict, InferenceEngine]:
    """{index: (tokens, logprobs, finish_reason)} of each prompt; request i is added before step arrivals[i]. The
    pool invariants are checked after every step."""
    engine = engine or InferenceEngine(model, config, eod=EOD)
    arrivals = arrivals or [0] * len(prompts)
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    results: dict = {i: ([], [], None) for i in range(len(prompts))}
    step = 0
    while pending or engine.has_work():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params)
        for out in engine.step():
            tokens, logprobs, _ = results[int(out.request_id)]
            tokens.extend(out.new_tokens)
            logprobs.extend(out.new_logprobs or [])
            if out.finished:
                results[int(out.request_id)] = (tokens, logprobs, out.finish_reason)
        engine.pool.check()
        step += 1
        assert step < 10_000
    return results, engine


def static_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """Today's static generator, greedy, no early stop: (generated tokens, their log-probs)."""
    out = generate_tokens(model, [prompt], new, eod_id=EOD, greedy=True, return_output_log_probs=True,
                          use_eod_token_for_early_termination=False)
    return out.tokens[0, len(prompt):].tolist(), out.logprobs[0, len(prompt) - 1:].tolist()
