"""OpenAI-compatible /v1/completions and /v1/models on the REST server, driven by the real `openai` client and plain
HTTP: greedy text equals generate(), stop strings, echo + logprobs equal a direct forward, streaming, seeded sampling,
OpenAI-shaped 4xx errors after which the server keeps answering, and a TP=2 server giving the TP=1 answers."""
from __future__ import annotations

import json
import time

import pytest
import torch

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from megatron.text_generation import generate
from megatron.text_generation.server import build_server
from tests.dist_utils import run_distributed
from tests.text_generation.test_server_http import CONTEXT, call, openai_served, post, tiny_gpt, tiny_tokenizer

openai = pytest.importorskip("openai")
REAL_VOCAB = 5000
PROMPTS = ["The meaning of life is", "Hello there, my friend"]


@pytest.fixture(scope="module")
def served(shared_data):
    yield from openai_served(tiny_gpt(), tiny_tokenizer(shared_data))


def greedy_reference(model, tokenizer, prompt: str, n: int) -> str:
    out = generate(model, tokenizer, [prompt], n, greedy=True)
    gen = out["tokens"][0][len(tokenizer.tokenize(prompt)):]
    if tokenizer.eod in gen:
        gen = gen[: gen.index(tokenizer.eod)]
    return tokenizer.detokenize(gen)


def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[j+1] | ids[..j]) and the per-position log-softmax rows [s-1, v] over the real vocabulary."""
    n = len(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(n)[None], torch.ones(1, 1, n, n, dtype=torch.bool).triu(1))
    return torch.log_softmax(logits[0, :-1, :REAL_VOCAB].double(), -1)


def test_client_greedy_equals_generate(served):
    address, model, tokenizer, client = served
    res = client.completions.create(model="anything", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert res.object == "text_completion" and res.id.startswith("cmpl-") and res.created > 0
    assert res.model == "anything" and len(res.choices) == 1
    choice = res.choices[0]
    assert choice.text == greedy_reference(model, tokenizer, PROMPTS[0], 8)
    assert choice.finish_reason == "length" and choice.index == 0 and choice.logprobs is None
    n_prompt = len(tokenizer.tokenize(PROMPTS[0]))
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == (n_prompt, 8,
                                                                                               n_prompt + 8)
    # a batch of prompts (strings and token ids) gives each prompt's own greedy text
    batch = client.completions.create(model="m", prompt=PROMPTS, max_tokens=6, temperature=0)
    ids = client.completions.create(model="m", prompt=[tokenizer.tokenize(p) for p in PROMPTS], max_tokens=6,
                                    temperature=0)
    for i, p in enumerate(PROMPTS):
        assert batch.choices[i].text == ids.choices[i].text == greedy_reference(model, tokenizer, p, 6)
    models = client.models.list()
    assert [m.id for m in models.data] == ["megatron-gpt"]


def test_stop_strings_cut_the_text(served):
    address, model, tokenizer, client = served
    full = greedy_reference(model, tokenizer, PROMPTS[0], 12)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    res = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop, "zzzq"],
                                    logprobs=1)
    choice = res.choices[0]
    assert choice.text == full[: full.index(stop)] and choice.finish_reason == "stop"
    assert stop not in choice.text
    # the tokens reported cover the kept text (the last one may hold the start of the stop string)
    assert "".join(choice.logprobs.tokens).startswith(choice.text)
    assert res.usage.completion_tokens == len(choice.logprobs.tokens) < 12


def test_echo_logprobs_equal_a_direct_forward(served):
    address, model, tokenizer, client = served
    prompt = "The cat sat on the mat and"
    res = client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=3)
    choice = res.choices[0]
    ids = tokenizer.tokenize(prompt)
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and choice.text == prompt + greedy_reference(model, tokenizer, prompt, 3)
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    full = ids + tokenizer.tokenize(choice.text[len(prompt):])
    rows = direct_logprobs(model, full)
    expected = rows.gather(1, torch.tensor(full[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:], dtype=torch.float64), expected, atol=1e-5)
    for j, top in enumerate(lp.top_logprobs[1:]):
        values, top_ids = torch.topk(rows[j], 3)
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-5)
        assert list(top) == [tokenizer.detokenize([int(t)]) for t in top_ids]
    assert lp.text_offset == [len("".join(lp.tokens[:j])) for j in range(len(lp.tokens))]
    # generated tokens are greedy: their log-prob is the top one
    for tok_lp, top in zip(lp.token_logprobs[-3:], lp.top_logprobs[-3:]):
        assert tok_lp == max(top.values())
    # lm-eval local-completions' log-likelihood request: token ids, max_tokens 1, echo, logprobs 1
    status, body = post(address, {"model": "m", "prompt": [full], "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                  "echo": True, "seed": 1234})
    assert status == 200
    scored = body["choices"][0]["logprobs"]["token_logprobs"]
    assert scored[1: len(full)] == pytest.approx(expected.tolist(), abs=1e-5) and len(scored) == len(full) + 1
    # max_tokens 0 with echo: only the prompt, scored
    status, body = post(address, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert status == 200 and body["choices"][0]["text"] == prompt and body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(expected[: len(ids) - 1].tolist(),
                                                                                 abs=1e-5)


def test_streaming_and_seeded_sampling(served):
    address, model, tokenizer, client = served
    plain = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 2
    assert all(c.id == chunks[0].id for c in chunks)
    # stop strings and echo: the streamed pieces add up to the plain answer, never past the stop string
    full = plain.choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    kw = dict(model="m", prompt=PROMPTS, max_tokens=10, temperature=0, stop=[stop], echo=True, logprobs=1)
    plain2 = client.completions.create(**kw)
    chunks2 = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for i in range(len(PROMPTS)):
        pieces = [c.choices[0] for c in chunks2 if c.choices and c.choices[0].index == i]
        assert "".join(p.text for p in pieces) == plain2.choices[i].text
        assert pieces[-1].finish_reason == plain2.choices[i].finish_reason
        assert pieces[-1].logprobs.token_logprobs[1:] == pytest.approx(plain2.choices[i].logprobs.token_logprobs[1:])
    assert chunks2[-1].usage.total_tokens == plain2.usage.total_tokens
    a = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    b = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    c = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=10, temperature=1.0, seed=8,
                                    extra_body={"top_k": 40})
    assert a.choices[0].text == b.choices[0].text and c.choices[0].text  # same seed, same sample


@pytest.mark.parametrize("payload,param,message", [
    ({"prompt": "x", "n": 2}, "n", "must be 1"),
    ({"prompt": "x", "best_of": 3}, "best_of", "must be 1"),
    ({"prompt": "x", "bogus": 1}, "bogus", "unrecognized"),
    ({"prompt": 5}, "prompt", "prompt must be"),
    ({"prompt": ["a", 3]}, "prompt", "not a mix"),
    ({"prompt": [[1, 99999]]}, "prompt", "outside the vocabulary"),
    ({"max_tokens": 3}, "prompt", "missing"),
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens", "integer"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "only with echo"),
    ({"prompt": "x", "max_tokens": 33}, "max_tokens", "limit of 32"),
    ({"prompt": "word " * 60, "max_tokens": 10}, "max_tokens", "maximum context length"),
    ({"prompt": "x", "temperature": -1}, "temperature", "[0.0, 2.0]"),
    ({"prompt": "x", "top_k": 5, "top_p": 0.5}, "top_k", "not both"),
    ({"prompt": "x", "logprobs": 6}, "logprobs", "[0, 5]"),
    ({"prompt": "x", "stop": list("abcdefghijklmnopq")}, "stop", "up to 16"),
    ({"prompt": "x", "echo": "yes"}, "echo", "true or false"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": ["a"] * 5}, "prompt", "too many prompts"),
])
def test_bad_requests_get_openai_errors(served, payload, param, message):
    address = served[0]
    status, body = post(address, payload)
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    assert message in body["error"]["message"]
    assert post(address, {"prompt": "ok", "max_tokens": 2, "temperature": 0})[0] == 200  # still serving


def test_http_edges_and_client_errors(served):
    address, _, _, client = served
    status, body = post(address, b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post(address, b'{"prompt": ' + b"[" * 200 + b"]" * 200 + b"}")  # no RecursionError
    assert status == 400 and "deeper than 32 levels" in body["error"]["message"]
    status, body = post(address, json.dumps({"prompt": "x" * 5000}).encode())
    assert status == 413 and "limit" in body["error"]["message"]
    assert call(address, "GET", "/v1/completions")[0] == 405
    assert call(address, "POST", "/v1/models", b"{}")[0] == 405
    status, body = call(address, "GET", "/models")
    assert status == 200 and body["object"] == "list"
    status, body = post(address, {"prompt": "Hi", "max_tokens": 2}, path="/completions")  # no /v1 prefix
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="must be 1"):
        client.completions.create(model="m", prompt="x", max_tokens=2, n=2)
    assert client.completions.create(model="m", prompt="x", max_tokens=2, temperature=0).choices[0].text is not None


# ----------------------------------------------------------------------------------------------- TP=2 server
def _tp2_body(rank: int, world_size: int, full_state: dict, shared_data) -> dict:
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        model = tiny_gpt(tp=2, tp_rank=state.tp_rank, pp_state=state)
        model.load_state_dict(split_tensor_parallel_state_dict(full_state, 2)[state.tp_rank])
        server = build_server(model, tiny_tokenizer(shared_data), max_sequence_length=CONTEXT, heartbeat_s=0.2,
                              log=lambda msg: None)
        if rank != 0:
            server.worker_loop()
            return {}
        address = server.start("127.0.0.1", 0)
        time.sleep(0.5)  # heartbeats while idle
        bad = post(address, {"prompt": "x", "n": 3})
        good = post(address, {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True})
        server.shutdown()
        return {"bad": bad, "good": good}
    finally:
        destroy_model_parallel()


def test_tp2_server_equals_tp1(served, shared_data):
    address, model, _, _ = served
    status, reference = post(address, {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "logprobs": 2,
                                       "echo": True})
    assert status == 200
    rank0, _ = run_distributed(_tp2_body, world_size=2, args=(model.state_dict(), shared_data))
    assert rank0["bad"][0] == 400
    status, body = rank0["good"]
    assert status == 200
    for ours, ref in zip(body["choices"], reference["choices"]):
        assert ours["text"] == ref["text"] and ours["logprobs"]["tokens"] == ref["logprobs"]["tokens"]
        assert ours["logprobs"]["token_logprobs"][1:] == pytest.approx(ref["logprobs"]["token_logprobs"][1:],
                                                                       abs=1e-5)


# ----------------------------------------------------------------------------------------------- lm-eval client
@pytest.mark.slow  # lm-eval starts `git` processes
def test_lm_eval_local_completions_equals_in_process_adapter(served, shared_data, tmp_path, monkeypatch):
    """lm-eval's `local-completions` model pointed at the server scores the local tasks like the in-process adapter.

    local-completions sends (context + continuation)[-(max_length - 1):] with max_tokens 1 and reads the echoed
    prompt log-probs, so with max_length 64 its contexts are those of the adapter at max_length 62.
    """
    lm_eval = pytest.importorskip("lm_eval")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from tasks.eval_harness.adapter import MegatronLM
    from tasks.eval_harness.evaluate import task_manager
    from tests.tasks.test_eval_harness import LOCAL_TASKS, _metrics

    address, model, tokenizer, _ = served
    owt = shared_data / "openwebtext-1000"
    hf_tok = transformers.GPT2TokenizerFast(vocab=str(owt / "gpt2-tiny-vocab.json"),
                                            merges=str(owt / "gpt2-tiny-merges.txt"), eos_token="<|endoftext|>",
                                            bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    hf_tok.save_pretrained(tmp_path / "tok")
    names = ["lambada_local", "mc_local", "qa_gen_local"]
    kw = dict(tasks=names, limit=4, bootstrap_iters=0, task_manager=task_manager(LOCAL_TASKS, names), log_samples=False)
    remote = LocalCompletionsAPI(base_url=f"http://{address[0]}:{address[1]}/v1/completions", model="megatron-gpt",
                                 tokenizer_backend="huggingface", tokenizer=str(tmp_path / "tok"), max_length=64,
                                 max_gen_toks=8, batch_size=1, max_retries=1)
    ours = _metrics(lm_eval.simple_evaluate(model=MegatronLM(model, tokenizer, max_length=62, max_gen_toks=8,
                                                             progress=False), **kw))
    theirs = _metrics(lm_eval.simple_evaluate(model=remote, **kw))
    assert set(ours) == set(theirs) and len(ours) >= 5
    for key, value in ours.items():
        if key[1].startswith(("acc", "exact_match")):
            assert theirs[key] == value, key
        else:
            assert theirs[key] == pytest.approx(value, rel=1e-5), key


def _pp2_body(rank: int, world_size: int, full_state: dict, shared_data, payload: dict) -> object:
    from tests.text_generation.test_generate_pp import _stage_model

    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        model = _stage_model(state, full_state, 1, padded_vocab_size=5120)
        server = build_server(model, tiny_tokenizer(shared_data), max_sequence_length=CONTEXT, log=lambda msg: None)
        if rank != 0:
            server.worker_loop()
            return None
        address = server.start("127.0.0.1", 0)
        answer = post(address, payload)
        server.shutdown()
        return answer
    finally:
        destroy_model_parallel()


def test_pp2_server_equals_pp1(shared_data):
    from megatron.models.gpt.model import GPTModel
    from tests.text_generation.helpers import tiny_config
    from tests.text_generation.test_generate_pp import LAYERS

    torch.manual_seed(4321)
    model = GPTModel(tiny_config(num_layers=LAYERS, padded_vocab_size=5120)).eval()
    payload = {"prompt": PROMPTS, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True}
    server = build_server(model, tiny_tokenizer(shared_data), max_sequence_length=CONTEXT, log=lambda msg: None)
    address = server.start("127.0.0.1", 0)
    try:
        status, reference = post(address, payload)
    finally:
        server.shutdown()
    assert status == 200
    status, body = run_distributed(_pp2_body, world_size=2, args=(model.state_dict(), shared_data, payload))[0]
    assert status == 200
    for ours, ref in zip(body["choices"], reference["choices"]):
        assert ours["text"] == ref["text"]
        assert ours["logprobs"]["tokens"] == ref["logprobs"]["tokens"]
        assert ours["logprobs"]["token_logprobs"][1:] == pytest.approx(ref["logprobs"]["token_logprobs"][1:],
                                                                       abs=1e-5)


def test_text_stream_sends_while_generating_and_holds_back_stop_prefixes(served):
    from megatron.text_generation.openai_api import OpenAICompletions, TextStream

    _, model, tokenizer, _ = served
    api = OpenAICompletions(model, tokenizer, max_sequence_length=CONTEXT)
    req = api.validate({"prompt": "Q:", "stop": [" is a", "\n"], "max_tokens": 20})
    sent: list[str] = []
    stream = TextStream(api, req, 0, lambda i, text: sent.append(text))
    generated = tokenizer.tokenize(" Hello world, this is a test")
    for n in range(1, len(generated) + 1):
        stream.feed(generated[:n])
        assert " is a" not in "".join(sent)
    assert "".join(sent).startswith(" Hello world")  # sent before the end of generation
    assert "".join(sent) == " Hello world, this"  # everything before the stop string, nothing after
    stream.finish(" Hello world, this")
    assert "".join(sent) == " Hello world, this"


def test_null_fields_mean_absent(served):
    """OpenAI's API treats null optional fields as absent; lm-eval 0.4's local-completions sends "model": null."""
    address = served[0]
    status, body = post(address, {"prompt": "ok", "max_tokens": 2, "temperature": 0, "model": None, "echo": None,
                                  "stop": None, "logprobs": None, "seed": None, "stream": None})
    assert status == 200, body
    assert body["model"] == "megatron-gpt" and body["choices"][0]["finish_reason"] in ("stop", "length")
    status, body = post(address, {"prompt": None})
    assert status == 400 and body["error"]["param"] == "prompt"


def readme_lm_eval_model_args() -> str:
    """The --model_args of the README's `lm_eval --model local-completions` command, as written."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    command = re.search(r"^lm_eval --model local-completions .*?(?<!\\)\n", readme, flags=re.S | re.M).group(0)
    return re.search(r"--model_args (\S+)", command).group(1)


@pytest.mark.slow  # lm-eval starts `git` processes
def test_lm_eval_client_with_the_readmes_model_args(served, shared_data, tmp_path, monkeypatch):
    """lm-eval's own client, built from exactly the README's model_args (server address and tokenizer folder
    swapped for this test's), scores a local task against the server: no "model must be a string" 400."""
    lm_eval = pytest.importorskip("lm_eval")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from tasks.eval_harness.evaluate import task_manager
    from tests.tasks.test_eval_harness import LOCAL_TASKS, _metrics

    address = served[0]
    model_args = readme_lm_eval_model_args()
    assert model_args.startswith("base_url=http://localhost:5000/v1/completions,tokenizer=") and "model=" not in model_args
    owt = shared_data / "openwebtext-1000"
    transformers.GPT2TokenizerFast(vocab=str(owt / "gpt2-tiny-vocab.json"), merges=str(owt / "gpt2-tiny-merges.txt"),
                                   eos_token="<|endoftext|>").save_pretrained(tmp_path / "tok")
    tokenizer_dir = model_args.split("tokenizer=", 1)[1].split(",")[0]
    assert "max_length=128" in model_args  # the quick-start model's --seq-length
    model_args = model_args.replace("localhost:5000", f"{address[0]}:{address[1]}").replace(
        f"tokenizer={tokenizer_dir}", f"tokenizer={tmp_path / 'tok'}").replace("max_length=128", f"max_length={CONTEXT}")
    remote = LocalCompletionsAPI.create_from_arg_string(model_args, {"batch_size": 1, "max_retries": 1})
    assert remote.model is None  # what the README's command sends: "model": null
    results = lm_eval.simple_evaluate(model=remote, tasks=["lambada_local"], limit=2, bootstrap_iters=0,
                                      task_manager=task_manager(LOCAL_TASKS, ["lambada_local"]), log_samples=False)
    metrics = _metrics(results)
    assert any(key[1].startswith("acc") for key in metrics) and all(v == v for v in metrics.values()), metrics
