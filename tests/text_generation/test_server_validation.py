"""validate_request: every malformed or out-of-range request is refused with a message naming the field."""
from __future__ import annotations

import pytest

from megatron.text_generation.server import BadRequest, accepted_options, validate_request


def _count(text: str) -> int:
    return len(text.split())


def _check(payload, accepted=None, **limits):
    kwargs = dict(count_tokens=_count, max_sequence_length=32, max_tokens_to_generate=16, max_prompts=4,
                  max_batch_tokens=100, accepted=accepted)
    kwargs.update(limits)
    return validate_request(payload, **kwargs)


BAD = [
    ([], "JSON object"),
    ({"tokens_to_generate": 3}, "missing field prompts"),
    ({"prompts": "hi"}, "list of strings"),
    ({"prompts": [1, 2]}, "list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": ["a"] * 5}, "too many prompts"),
    ({"prompts": [""]}, "prompts[0] is empty"),
    ({"prompts": ["a"], "tokens_to_generate": "5"}, "tokens_to_generate must be a number"),
    ({"prompts": ["a"], "tokens_to_generate": 2.5}, "must be an integer"),
    ({"prompts": ["a"], "tokens_to_generate": True}, "must be a number"),
    ({"prompts": ["a"], "tokens_to_generate": -1}, ">= 0"),
    ({"prompts": ["a"], "tokens_to_generate": 0}, "logprobs"),
    ({"prompts": ["a"], "tokens_to_generate": 17}, "--max-tokens-to-generate"),
    ({"prompts": ["w " * 30], "tokens_to_generate": 5}, "context of 32 tokens"),
    ({"prompts": ["w " * 10] * 4, "tokens_to_generate": 16}, "--max-tokens-to-oom"),
    ({"prompts": ["a"], "temperature": -0.5}, "temperature"),
    ({"prompts": ["a"], "temperature": float("nan")}, "finite"),
    ({"prompts": ["a"], "top_p": 1.5}, "top_p must be in [0, 1]"),
    ({"prompts": ["a"], "top_p": -0.1}, "top_p must be in [0, 1]"),
    ({"prompts": ["a"], "top_k": -2}, "top_k must be >= 0"),
    ({"prompts": ["a"], "top_k": 5, "top_p": 0.9}, "not both"),
    ({"prompts": ["a"], "logprobs": 1}, "logprobs must be true or false"),
    ({"prompts": ["a"], "random_seed": -7}, "random_seed"),
    ({"prompts": ["a"], "beam_width": 2}, "unknown field(s) beam_width"),
    ({"prompts": ["a"], "stop_on_double_eol": True}, "not supported"),  # generate below has no such option
]


def _generate(prompts, tokens_to_generate, *, return_output_log_probs=False, top_k=0, top_p=0.0, temperature=1.0,
              add_BOS=False, stop_on_eol=False, random_seed=-1):
    raise AssertionError("never called")


@pytest.mark.parametrize("payload,message", BAD, ids=[m for _, m in BAD])
def test_bad_requests_are_refused_with_a_message(payload, message):
    with pytest.raises(BadRequest) as info:
        _check(payload, accepted=accepted_options(_generate))
    assert message in str(info.value)


def test_good_request_maps_to_generate_keywords():
    out = _check({"prompts": ["a b", "c"], "tokens_to_generate": 4, "logprobs": True, "top_p": 0.9,
                  "temperature": 0.7, "add_BOS": True, "random_seed": 3}, accepted=accepted_options(_generate))
    assert out["prompts"] == ["a b", "c"] and out["tokens_to_generate"] == 4
    assert out["options"] == dict(return_output_log_probs=True, temperature=0.7, top_k=0, top_p=0.9, add_BOS=True,
                                  stop_on_eol=False, random_seed=3)


def test_defaults_greedy_and_bos():
    out = _check({"prompts": ["a"]}, max_tokens_to_generate=None, max_sequence_length=100)
    assert out["tokens_to_generate"] == 64  # Megatron's default
    assert _check({"prompts": ["a"]})["tokens_to_generate"] == 16  # capped by --max-tokens-to-generate
    greedy = _check({"prompts": ["a"], "temperature": 0, "tokens_to_generate": 2})
    assert greedy["options"]["top_k"] == 1 and greedy["options"]["temperature"] == 1.0
    # an empty prompt is fine once BOS gives it a token; the BOS counts against the context
    assert _check({"prompts": [""], "add_BOS": True, "tokens_to_generate": 2})["prompts"] == [""]
    with pytest.raises(BadRequest, match="context"):
        _check({"prompts": ["w " * 16], "add_BOS": True, "tokens_to_generate": 16})
    assert _check({"prompts": ["w " * 16], "tokens_to_generate": 16})["tokens_to_generate"] == 16
