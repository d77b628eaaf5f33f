"""The inference engine (megatron/inference/): each request's greedy tokens and log-probs are the same alone, among
16 others arriving at random steps (with and without prefix sharing and chunked prefill) and from today's static
generator, for a Llama-like and an MLA model; the other families; seeded sampling; queueing, cancelling and the
one-line refusals."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from megatron.inference import EngineConfig, InferenceEngine, RequestRejected, SamplingParams
from megatron.text_generation.generation import generate_tokens
from tests.inference.helpers import EOD, random_prompts, run, static_greedy
from tests.model.helpers import VOCAB, build_gpt, tiny_config

NEW = 8
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
             group_query_attention=True, num_query_groups=2, max_position_embeddings=32)
MLA = dict(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope",
           add_bias_linear=False, swiglu=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6, max_position_embeddings=32)
GREEDY = SamplingParams(max_new_tokens=NEW, greedy=True, return_logprobs=True, stop_on_eod=False)
LAYOUTS = {  # (prefix sharing, chunked prefill): the engine config
    "plain": EngineConfig(num_blocks=48, block_size=4, max_tokens=64, prefix_caching=False),
    "prefix": EngineConfig(num_blocks=48, block_size=4, max_tokens=64, prefix_caching=True),
    "chunked": EngineConfig(num_blocks=48, block_size=4, max_tokens=8, chunked_prefill=True, prefix_caching=False),
    "both": EngineConfig(num_blocks=48, block_size=4, max_tokens=8, chunked_prefill=True, prefix_caching=True),
}


@pytest.fixture(scope="module", params=["llama", "mla"])
def family(request):
    """(model, 17 prompts, each prompt's static greedy tokens and log-probs, each prompt's engine run alone)."""
    model = build_gpt(tiny_config(**(LLAMA if request.param == "llama" else MLA))).eval()
    prompts = random_prompts(17, VOCAB, seed=3)
    static = [static_greedy(model, p, NEW) for p in prompts]
    alone = [run(model, [p], LAYOUTS["plain"], GREEDY)[0][0] for p in prompts]
    return model, prompts, static, alone


def test_alone_equals_static_generate(family):
    _, prompts, static, alone = family
    for (tokens, logprobs), (a_tokens, a_logprobs, reason) in zip(static, alone):
        assert a_tokens == tokens and reason == "length"
        torch.testing.assert_close(torch.tensor(a_logprobs), torch.tensor(logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_among_16_others_at_random_steps_equals_alone(family, layout):
    model, prompts, static, alone = family
    arrivals = [random.Random(i).randrange(12) for i in range(len(prompts))]
    results, engine = run(model, prompts, LAYOUTS[layout], GREEDY, arrivals)
    for i in range(len(prompts)):
        assert results[i][0] == alone[i][0] == static[i][0], i
        torch.testing.assert_close(torch.tensor(results[i][1]), torch.tensor(alone[i][1]), rtol=0, atol=1e-5)
    stats = engine.stats
    assert stats.running == stats.queued == 0 and stats.free_blocks == stats.total_blocks
    assert (stats.prefix_hit_blocks > 0) == LAYOUTS[layout].prefix_caching


@pytest.mark.parametrize("name,overrides", [
    ("gpt", dict(max_position_embeddings=32)),
    ("bloom-alibi", dict(position_embedding_type="alibi", max_position_embeddings=32)),
    ("mistral-window", dict(LLAMA, window_size=(5, 0))),
    ("qwen3-qk-norm-qkv-bias", dict(LLAMA, qk_layernorm=True, add_qkv_bias=True)),
    ("gpt-oss-sinks", dict(LLAMA, softmax_type="learnable")),
    ("moe", dict(LLAMA, num_moe_experts=4, moe_router_topk=2, ffn_hidden_size=48, moe_layer_freq=[1, 0])),
])
def test_families_batched_equal_static_generate(name, overrides):
    model = build_gpt(tiny_config(**overrides)).eval()
    prompts = random_prompts(6, VOCAB, seed=5)
    results, _ = run(model, prompts, LAYOUTS["both"], GREEDY, arrivals=[0, 0, 1, 2, 2, 4])
    for i, prompt in enumerate(prompts):
        tokens, logprobs = static_greedy(model, prompt, NEW)
        assert results[i][0] == tokens, (name, i)
        torch.testing.assert_close(torch.tensor(results[i][1]), torch.tensor(logprobs), rtol=0, atol=1e-5)


def test_seeded_sampling_is_the_same_alone_batched_and_static():
    model = build_gpt(tiny_config(**LLAMA)).eval()
    prompts = random_prompts(5, VOCAB, seed=9)
    params = [SamplingParams(max_new_tokens=NEW, top_k=5, temperature=0.8, seed=100 + i, stop_on_eod=False)
              for i in range(len(prompts))]
    engine = InferenceEngine(model, LAYOUTS["both"], eod=EOD)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    batched: dict = {i: [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            batched[int(out.request_id)].extend(out.new_tokens)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        ref = generate_tokens(model, [p], NEW, eod_id=EOD, top_k=5, temperature=0.8, random_seed=sp.seed,
                              use_eod_token_for_early_termination=False)
        assert batched[i] == ref.tokens[0, len(p):].tolist()


def test_prompt_logprobs_equal_static_generate():
    model = build_gpt(tiny_config(**LLAMA)).eval()
    prompt = random_prompts(1, VOCAB, seed=2, shared_prefix=0, max_len=15)[0] + [3, 4]
    engine = InferenceEngine(model, LAYOUTS["chunked"], eod=EOD)
    engine.add_request("a", prompt, SamplingParams(max_new_tokens=3, greedy=True, return_logprobs=True,
                                                   return_prompt_logprobs=True, stop_on_eod=False))
    outs = []
    while engine.has_work():
        outs += engine.step()
    got = outs[0].prompt_logprobs + [lp for o in outs for lp in o.new_logprobs]
    ref = generate_tokens(model, [prompt], 3, eod_id=EOD, greedy=True, return_output_log_probs=True,
                          use_eod_token_for_early_termination=False)
    torch.testing.assert_close(torch.tensor(got), ref.logprobs[0], rtol=0, atol=1e-5)


def test_scoring_a_prompt_without_generating():
    model = build_gpt(tiny_config(**LLAMA)).eval()
    prompt = [5, 9, 2, 33, 4, 4, 17, 8, 1]  # 9 tokens: 3 blocks of 4, all written
    engine = InferenceEngine(model, EngineConfig(num_blocks=3, block_size=4), eod=EOD)
    engine.add_request("s", prompt, SamplingParams(max_new_tokens=0, return_prompt_logprobs=True))
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "length" and out.new_tokens == [] and not engine.has_work()
    ref = generate_tokens(model, [prompt, prompt], 0, eod_id=EOD, return_output_log_probs=True)
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), ref.logprobs[0], rtol=0, atol=1e-5)
    assert engine.stats.free_blocks == 3
    with pytest.raises(RequestRejected, match="0 only to score the prompt"):
        engine.add_request("t", prompt, SamplingParams(max_new_tokens=0))


def test_stop_tokens_end_a_request_and_free_its_blocks():
    model = build_gpt(tiny_config(**LLAMA)).eval()
    prompt = [1, 2, 3, 4, 5]
    tokens, _ = static_greedy(model, prompt, NEW)
    params = SamplingParams(max_new_tokens=NEW, greedy=True, stop_token_ids=(tokens[2],))
    results, engine = run(model, [prompt], LAYOUTS["plain"], params)
    assert results[0][0] == tokens[: tokens.index(tokens[2]) + 1] and results[0][2] == "stop"
    assert engine.stats.free_blocks == engine.stats.total_blocks


def test_requests_wait_for_blocks_when_the_pool_is_full():
    model = build_gpt(tiny_config(**LLAMA)).eval()
    prompts = random_prompts(6, VOCAB, seed=4)
    config = EngineConfig(num_blocks=8, block_size=4, max_tokens=64, prefix_caching=False)  # room for 1-2 requests
    engine = InferenceEngine(model, config, eod=EOD)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    tokens: dict = {i: [] for i in range(len(prompts))}
    most_running = 0
    while engine.has_work():
        for out in engine.step():
            tokens[int(out.request_id)] += out.new_tokens
        most_running = max(most_running, engine.stats.running)
        assert engine.stats.queued + engine.stats.running > 0 or not engine.has_work()
        engine.pool.check()
    assert most_running < len(prompts)  # the others waited in the queue
    for i, p in enumerate(prompts):
        assert tokens[i] == static_greedy(model, p, NEW)[0]


def test_cancel_frees_blocks_of_running_and_queued_requests():
    model = build_gpt(tiny_config(**LLAMA)).eval()
    config = EngineConfig(num_blocks=6, block_size=4, max_tokens=64)  # one request of 6 + 8 tokens: 4 blocks
    engine = InferenceEngine(model, config, eod=EOD)
    engine.add_request("run", [1, 2, 3, 4, 5, 6], GREEDY)
    engine.add_request("wait", [7, 8, 9, 10, 11, 12], GREEDY)
    engine.step()
    assert engine.stats.running == 1 and engine.stats.queued == 1
    engine.cancel("run")
    engine.cancel("wait")
    outs = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("run", "cancelled"), ("wait", "cancelled")]
    assert not engine.has_work() and engine.stats.free_blocks == engine.stats.total_blocks
    engine.pool.check()
    engine.add_request("run", [1, 2, 3], GREEDY)  # the ids are free again
    engine.add_request("wait", [1, 2, 3], GREEDY)


@pytest.mark.parametrize("config,prompt,params,message", [
    (EngineConfig(num_blocks=3, block_size=4), [1] * 10, SamplingParams(max_new_tokens=8), "needs 5 KV-cache blocks"),
    (EngineConfig(num_blocks=64, block_size=4), [1] * 30, SamplingParams(max_new_tokens=8), "max-position-embeddings"),
    (EngineConfig(num_blocks=64, block_size=4, max_tokens=4), [1] * 10, SamplingParams(), "enable-chunked-prefill"),
    (EngineConfig(num_blocks=64, block_size=4), [], SamplingParams(), "at least one prompt token"),
    (EngineConfig(num_blocks=64, block_size=4), [1], SamplingParams(top_k=2, top_p=0.5), "top_k or top_p"),
    (EngineConfig(num_blocks=64, block_size=4), [1], SamplingParams(temperature=0.0), "temperature must be > 0"),
    (EngineConfig(num_blocks=64, block_size=4), [1, VOCAB], SamplingParams(), "outside the vocabulary"),
    (EngineConfig(num_blocks=64, block_size=4), [-1], SamplingParams(), "outside the vocabulary"),
])
def test_requests_that_can_never_run_are_refused_in_one_line(config, prompt, params, message):
    engine = InferenceEngine(build_gpt(tiny_config(**LLAMA)).eval(), config, eod=EOD)
    with pytest.raises(RequestRejected, match=message) as info:
        engine.add_request("x", prompt, params)
    assert "\n" not in str(info.value)
    assert not engine.has_work()


def test_duplicate_ids_and_a_buffer_too_small_are_refused():
    model = build_gpt(tiny_config(**LLAMA)).eval()
    engine = InferenceEngine(model, EngineConfig(num_blocks=8, block_size=4), eod=EOD)
    engine.add_request("a", [1, 2], SamplingParams(greedy=True, temperature=0.0))  # greedy: any temperature
    with pytest.raises(RequestRejected, match="already in the engine"):
        engine.add_request("a", [1, 2], GREEDY)
    with pytest.raises(RequestRejected, match="holds no block"):
        InferenceEngine(model, EngineConfig(buffer_size_gb=1e-9, block_size=4), eod=EOD)
    sized = InferenceEngine(model, EngineConfig(buffer_size_gb=1 / 1024, block_size=4), eod=EOD)
    per_token = 2 * 2 * 2 * 8 * 4  # layers x (K, V) x groups x head dim x fp32 bytes
    assert sized.pool.num_blocks == 1024**2 // (4 * per_token)


@pytest.mark.parametrize("state,flag", [(SimpleNamespace(pp_size=1, cp_size=2), "context-parallel-size 1"),
                                        (SimpleNamespace(pp_size=1, ep_size=2), "expert-model-parallel-size 1")])
def test_context_and_expert_parallelism_are_refused_in_one_line(state, flag):
    model = build_gpt(tiny_config(**LLAMA)).eval()
    with pytest.raises(RequestRejected, match=flag) as info:
        InferenceEngine(model, LAYOUTS["plain"], eod=EOD, state=state)
    assert "\n" not in str(info.value)


def test_identical_prompts_share_their_full_blocks_and_answer_alike():
    model = build_gpt(tiny_config(**LLAMA)).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]  # two full blocks of 4: the first is shared (the last token is always fed)
    engine = InferenceEngine(model, LAYOUTS["prefix"], eod=EOD)
    first, _ = run(model, [prompt], LAYOUTS["prefix"], GREEDY, engine=engine)
    assert engine.stats.cached_blocks == 2 and engine.stats.prefix_hit_blocks == 0
    again, _ = run(model, [prompt, prompt], LAYOUTS["prefix"], GREEDY, engine=engine)
    assert engine.stats.prefix_hit_blocks == 2  # both later requests took block 0 from the cache
    assert again[0][0] == again[1][0] == first[0][0] == static_greedy(model, prompt, NEW)[0]
    torch.testing.assert_close(torch.tensor(again[1][1]), torch.tensor(first[0][1]), rtol=0, atol=1e-5)


def test_chunked_prefill_keeps_running_requests_decoding():
    model = build_gpt(tiny_config(**LLAMA)).eval()
    config = EngineConfig(num_blocks=48, block_size=4, max_tokens=6, chunked_prefill=True)
    engine = InferenceEngine(model, config, eod=EOD)
    params = SamplingParams(max_new_tokens=12, greedy=True, stop_on_eod=False)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5], params)
    engine.step()  # both prompts in one step
    long_prompt = list(range(1, 21))
    engine.add_request("long", long_prompt, params)
    steps_to_first_token = 0
    while True:
        outs = {o.request_id: o for o in engine.step()}
        steps_to_first_token += 1
        assert {"a", "b"} <= set(outs)  # the running requests got a token in every step of the long prefill
        if "long" in outs:
            break
    assert steps_to_first_token == 5  # 20 prompt tokens at 6 - 2 decodes = 4 per step
    tokens = outs["long"].new_tokens
    while engine.has_work():
        tokens += [t for o in engine.step() if o.request_id == "long" for t in o.new_tokens]
    assert tokens == static_greedy(model, long_prompt, 12)[0]
