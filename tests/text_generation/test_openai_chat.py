"""OpenAI-compatible /v1/chat/completions on the REST server, driven by the real `openai` client, plain HTTP and
lm-eval's `local-chat-completions`: the content is our greedy generation on the chat-templated prompt (plain and
streamed: role delta first), generation stops at the template's end-of-turn token (not in the content), log-probs
equal a direct forward, `n` choices, and OpenAI-shaped 4xx errors (no template, bad messages) after which the
server keeps answering."""
from __future__ import annotations

import pytest
import torch

from megatron.inference import EngineConfig, InferenceEngine, SamplingParams
from megatron.text_generation.generation import generate_tokens
from megatron.text_generation.openai_api import OpenAICompletions, OpenAIError
from megatron.text_generation.openai_chat import OpenAIChat
from megatron.text_generation.server import build_server
from megatron.tokenizer.hf_tokenizer import PretrainedFromHFTokenizer
from tests.text_generation.test_server_http import CONTEXT, call, openai_served, tiny_gpt, tiny_tokenizer
from tests.text_generation.test_server_http import post as post_json

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
END = "<|end|>"
# the end-of-turn token follows an assistant turn only, so a generation prompt never holds it
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}<|end|>"
            "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "The meaning of life is"}]
STOP_AT = 3  # the end-of-turn token takes the place of the greedy token at this step of CHAT's answer


def chat_tokenizer(shared_data, folder) -> PretrainedFromHFTokenizer:
    """The tiny GPT-2 vocabulary as a Hugging Face tokenizer with a chat template and one end-of-turn token."""
    owt = shared_data / "openwebtext-1000"
    hf = transformers.GPT2TokenizerFast(vocab=str(owt / "gpt2-tiny-vocab.json"),
                                        merges=str(owt / "gpt2-tiny-merges.txt"), eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    hf.add_special_tokens({"additional_special_tokens": [END]})
    hf.chat_template = TEMPLATE
    hf.save_pretrained(folder)
    return PretrainedFromHFTokenizer(str(folder))


def templated(tokenizer, messages) -> list[int]:
    out = tokenizer.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)
    return list(out["input_ids"])


def greedy(model, tokenizer, ids: list[int], n: int) -> list[int]:
    out = generate_tokens(model, [ids], n, eod_id=tokenizer.eod, greedy=True, vocab_size=tokenizer.vocab_size)
    return out.tokens[0, len(ids): int(out.lengths[0])].tolist()


@pytest.fixture(scope="module")
def served(shared_data, tmp_path_factory):
    tokenizer = chat_tokenizer(shared_data, tmp_path_factory.mktemp("chat_tok"))
    end = tokenizer.hf_tokenizer.convert_tokens_to_ids(END)
    model = tiny_gpt()
    prompt = templated(tokenizer, CHAT)
    answer = greedy(model, tokenizer, prompt, 8)
    swap = answer[STOP_AT]
    assert swap not in prompt + answer[:STOP_AT] and end not in prompt + answer
    with torch.no_grad():  # tied embeddings: end's logit becomes swap's (and neither is an input before the step)
        table = model.language_model.embedding.word_embeddings.weight
        table[[swap, end]] = table[[end, swap]].clone()
    yield from openai_served(model, tokenizer)


def post(address, payload, path: str = "/v1/chat/completions"):
    return post_json(address, payload, path)


def test_plain_and_streaming_equal_greedy_on_the_template(served):
    address, model, tokenizer, client = served
    messages = [{"role": "user", "content": "Hello there, my friend"}]
    prompt = templated(tokenizer, messages)
    expected = tokenizer.detokenize(greedy(model, tokenizer, prompt, 10))
    res = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
    assert res.object == "chat.completion" and res.id.startswith("chatcmpl-") and res.model == "m"
    choice = res.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(prompt), 10)
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and all(c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == expected and len([d for d in deltas if d]) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # n choices from one seeded sampling batch: reproducible with the seed
    kw = dict(model="m", messages=messages, max_tokens=6, temperature=1.0, n=3, seed=7)
    first, again = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == 18


def test_stops_at_the_end_of_turn_token(served):
    address, model, tokenizer, client = served
    prompt = templated(tokenizer, CHAT)
    answer = greedy(model, tokenizer, prompt, 8)
    end = tokenizer.hf_tokenizer.convert_tokens_to_ids(END)
    assert answer[STOP_AT] == end  # the swapped model ends its turn there
    res = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, logprobs=True)
    choice = res.choices[0]
    assert choice.message.content == tokenizer.detokenize(answer[:STOP_AT]) and END not in choice.message.content
    assert choice.finish_reason == "stop" and res.usage.completion_tokens == STOP_AT + 1
    assert [t.token for t in choice.logprobs.content] == [tokenizer.detokenize([t]) for t in answer[:STOP_AT]]
    chunks = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a user stop string cuts the content too
    stop = choice.message.content[1:3]
    cut = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == choice.message.content[:1] and cut.choices[0].finish_reason == "stop"


def test_logprobs_equal_a_direct_forward(served):
    address, model, tokenizer, client = served
    messages = [{"role": "user", "content": [{"type": "text", "text": "The cat sat"}, {"type": "text",
                                                                                       "text": " on the mat"}]}]
    prompt = templated(tokenizer, [{"role": "user", "content": "The cat sat on the mat"}])
    gen = greedy(model, tokenizer, prompt, 4)
    res = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = res.choices[0].logprobs.content
    ids = prompt + gen
    with torch.no_grad():
        n = len(ids)
        logits = model(torch.tensor([ids]), torch.arange(n)[None], torch.ones(1, 1, n, n, dtype=torch.bool).triu(1))
    rows = torch.log_softmax(logits[0, len(prompt) - 1: -1, : tokenizer.vocab_size].double(), -1)
    assert [c.token for c in content] == [tokenizer.detokenize([t]) for t in gen]
    for k, entry in enumerate(content):
        assert entry.logprob == pytest.approx(rows[k, gen[k]].item(), abs=1e-5)
        values, top = torch.topk(rows[k], 2)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.detokenize([int(i)]) for i in top]
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_engine_server_answers_as_the_static_one(served):
    """On the inference engine (--inference-dynamic-batching) the chat route gives the same replies, plain and
    streamed, and stops at the end-of-turn token there too."""
    address, model, tokenizer, client = served
    engine = InferenceEngine(model, EngineConfig(num_blocks=64, block_size=8, max_tokens=256), eod=int(tokenizer.eod))
    logs: list[str] = []
    server = build_server(model, tokenizer, max_sequence_length=CONTEXT, engine=engine, sampling_params=SamplingParams,
                          log=logs.append)
    host, port = server.start("127.0.0.1", 0)
    try:
        on_engine = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        for messages in (CHAT, [{"role": "user", "content": "Hello there, my friend"}]):
            kw = dict(model="m", messages=messages, max_tokens=8, temperature=0)
            static, engined = client.chat.completions.create(**kw), on_engine.chat.completions.create(**kw)
            streamed = list(on_engine.chat.completions.create(**kw, stream=True))
            assert engined.choices[0].message.content == static.choices[0].message.content
            assert engined.choices[0].finish_reason == static.choices[0].finish_reason
            assert engined.usage.completion_tokens == static.usage.completion_tokens
            assert "".join(c.choices[0].delta.content or "" for c in streamed) == static.choices[0].message.content
        assert static.choices[0].finish_reason == "length"  # the second conversation; CHAT's ends its turn
        assert sum("(engine" in line for line in logs) == 4
    finally:
        server.shutdown()


def test_bad_requests_get_openai_errors(served, shared_data):
    address, model, tokenizer, client = served
    for payload, needle in [
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0] must be an object with a role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls is not"),
        ({"messages": CHAT, "tools": []}, "unrecognized request argument(s): tools"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"messages": CHAT, "n": 9}, "n must be an integer in [1, 4]"),
        ({"messages": CHAT, "max_tokens": 4, "max_completion_tokens": 5}, "not both"),
        ({"messages": [{"role": "user", "content": "The cat sat on the mat. " * 8}], "max_tokens": 30},
         "maximum context length is 64"),
        ({"messages": CHAT, "presence_penalty": 1}, "presence_penalty is not supported"),
        ({"prompt": "x"}, "unrecognized request argument(s): prompt"),
    ]:
        status, body = post(address, payload)
        assert status == 400 and needle in body["error"]["message"], (payload, body)
        assert "\n" not in body["error"]["message"]
    status, body = post(address, b"x" * 5000)
    assert status == 413 and "over the limit" in body["error"]["message"]
    assert call(address, "GET", "/v1/chat/completions")[0] == 405
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=100)
    # a tokenizer without a chat template: one line saying so
    plain = OpenAIChat(OpenAICompletions(model, tiny_tokenizer(shared_data), max_sequence_length=CONTEXT))
    with pytest.raises(OpenAIError, match=r"^this model's tokenizer \(GPT2BPETokenizer\) has no chat template;"):
        plain.validate({"messages": CHAT})
    # still serving
    assert client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, temperature=0).choices


@pytest.mark.slow  # lm-eval runs `pip list`
def test_lm_eval_local_chat_completions(served, monkeypatch):
    """lm-eval's `local-chat-completions` on the local generation task, chat template applied: every answer is the
    server's greedy answer on the templated question, cut at the task's stop strings."""
    lm_eval = pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.models.openai_completions import LocalChatCompletion
    from lm_eval.tasks import TaskManager

    from tests.tasks.test_eval_harness import LOCAL_TASKS

    address, model, tokenizer, _ = served
    remote = LocalChatCompletion(base_url=f"http://{address[0]}:{address[1]}/v1/chat/completions", model="m",
                                 max_gen_toks=8, max_retries=1)
    results = lm_eval.simple_evaluate(model=remote, tasks=["qa_gen_local"], limit=3, bootstrap_iters=0,
                                      apply_chat_template=True,
                                      task_manager=TaskManager(include_path=LOCAL_TASKS, include_defaults=False),
                                      log_samples=True)
    samples = results["samples"]["qa_gen_local"]
    assert len(samples) == 3 and any(sample["resps"][0][0] for sample in samples)
    for sample in samples:
        question = f"Question: {sample['doc']['question']}\nAnswer:"
        text = tokenizer.detokenize(greedy(model, tokenizer, templated(tokenizer, [
            {"role": "user", "content": question}]), 8))
        for stop in ("\n", "."):
            text = text.split(stop)[0]
        assert sample["resps"] == [[text]], sample
