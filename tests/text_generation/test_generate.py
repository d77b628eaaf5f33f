"""generate(): greedy equals Hugging Face GPT-2, KV cache equals recompute, log-probs, early stop at eod."""
from __future__ import annotations

import pytest
import torch

from megatron.models.gpt.hf_gpt2 import hf_gpt2_config_kwargs, megatron_gpt_to_hf_state_dict
from megatron.text_generation import generate, generate_tokens
from tests.text_generation.helpers import PROMPTS, VOCAB, build_model, full_logits, tiny_config

EOD = VOCAB - 1
NEW = 12


def test_greedy_equals_hf_generate_batched_prompts():
    transformers = pytest.importorskip("transformers")
    model = build_model()
    config = tiny_config()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_gpt2_config_kwargs(config))).eval()
    hf.load_state_dict(megatron_gpt_to_hf_state_dict(model.state_dict_for_save_checkpoint(), config), strict=False)
    out = generate(model, None, PROMPTS, NEW, greedy=True, eod_id=EOD, use_eod_token_for_early_termination=False)
    for prompt, row, n in zip(PROMPTS, out["tokens"], out["lengths"]):
        assert n == len(prompt) + NEW and row[: len(prompt)] == prompt
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert row == ref[0].tolist()
    assert len({tuple(r[3:]) for r in out["tokens"]}) == len(PROMPTS)  # rows really differ


@pytest.mark.parametrize("sampling", [dict(greedy=True), dict(top_k=5, temperature=0.8), dict(top_p=0.9)])
def test_kv_cache_equals_recompute(sampling):
    model = build_model()
    kw = dict(eod_id=EOD, random_seed=11, return_output_log_probs=True, use_eod_token_for_early_termination=False)
    cached = generate(model, None, PROMPTS, NEW, use_kv_cache=True, **sampling, **kw)
    recomputed = generate(model, None, PROMPTS, NEW, use_kv_cache=False, **sampling, **kw)
    assert cached["tokens"] == recomputed["tokens"]
    for a, b in zip(cached["logprobs"], recomputed["logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


def test_logprobs_equal_log_softmax_of_full_forward():
    model = build_model()
    out = generate(model, None, PROMPTS, NEW, top_k=10, random_seed=3, eod_id=EOD, return_output_log_probs=True,
                   use_eod_token_for_early_termination=False)
    for row, lps in zip(out["tokens"], out["logprobs"]):
        assert len(lps) == len(row) - 1
        ref = torch.log_softmax(full_logits(model, row), dim=-1)[:-1].gather(1, torch.tensor(row[1:])[:, None])
        torch.testing.assert_close(torch.tensor(lps), ref[:, 0], rtol=1e-5, atol=1e-5)


def test_logprobs_of_prompts_with_nothing_to_generate():
    model = build_model()
    rows = [p[:4] for p in PROMPTS if len(p) >= 4][:2]  # equal lengths: the decoding loop never runs
    out = generate(model, None, rows, 0, eod_id=EOD, return_output_log_probs=True)
    assert out["tokens"] == rows
    for row, lps in zip(rows, out["logprobs"]):
        ref = torch.log_softmax(full_logits(model, row), dim=-1)[:-1].gather(1, torch.tensor(row[1:])[:, None])
        torch.testing.assert_close(torch.tensor(lps), ref[:, 0], rtol=1e-5, atol=1e-5)


def test_early_stop_at_eod():
    model = build_model()
    free = generate(model, None, PROMPTS, NEW, greedy=True, eod_id=EOD, use_eod_token_for_early_termination=False)
    row0 = free["tokens"][0]
    start = len(PROMPTS[0])
    eod = row0[start + 2]  # pretend the 3rd generated token of row 0 is end-of-document
    stopped = generate(model, None, PROMPTS, NEW, greedy=True, eod_id=eod)
    first = start + row0[start:].index(eod)
    assert stopped["lengths"][0] == first + 1 and stopped["tokens"][0] == row0[: first + 1]
    for i, (prompt, row) in enumerate(zip(PROMPTS, free["tokens"])):
        gen = row[len(prompt):]
        expected = len(prompt) + gen.index(eod) + 1 if eod in gen else len(prompt) + NEW
        assert stopped["lengths"][i] == expected and stopped["tokens"][i] == row[:expected]
    # once every row has ended the loop stops: a single row stops right after its eod
    raw = generate_tokens(model, PROMPTS[:1], NEW, eod_id=eod, greedy=True)
    assert raw.tokens.shape == (1, first + 1)
    assert generate(model, None, PROMPTS[:1], NEW, greedy=True, eod_id=eod,
                    use_eod_token_for_early_termination=False)["lengths"] == [start + NEW]


def test_top_k_1_equals_greedy_and_seeds_reproduce():
    model = build_model()
    greedy = generate(model, None, PROMPTS, NEW, greedy=True, eod_id=EOD, use_eod_token_for_early_termination=False)
    topk1 = generate(model, None, PROMPTS, NEW, top_k=1, random_seed=5, eod_id=EOD,
                     use_eod_token_for_early_termination=False)
    assert greedy["tokens"] == topk1["tokens"]
    kw = dict(eod_id=EOD, temperature=1.5, use_eod_token_for_early_termination=False)
    a = generate(model, None, PROMPTS, NEW, random_seed=42, **kw)
    b = generate(model, None, PROMPTS, NEW, random_seed=42, **kw)
    c = generate(model, None, PROMPTS, NEW, random_seed=43, **kw)
    assert a["tokens"] == b["tokens"] and a["tokens"] != c["tokens"]


def test_text_prompts_with_gpt2_tokenizer(shared_data):
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

    owt = shared_data / "openwebtext-1000"
    tok = GPT2BPETokenizer(str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt"))
    model = build_model()
    # the tiny model's vocab (128) is smaller than the tokenizer's: feed only ids it has
    prompts = ["a b", "the"]
    ids = [[t % VOCAB for t in tok.tokenize(p)] for p in prompts]
    out = generate(model, tok, ids, 4, greedy=True, eod_id=EOD, return_output_log_probs=True)
    assert len(out["text"]) == 2 and all(isinstance(t, str) for t in out["text"])
    assert [len(s) for s in out["segments"]] == out["lengths"]
    assert "".join(out["segments"][0]) == out["text"][0]
    with pytest.raises(ValueError, match="max-position-embeddings"):
        generate(model, None, [[1, 2]], 100, eod_id=EOD)


class _CharTokenizer:
    """ids = character codes (mod VOCAB); '\\n' is the single token `eol`."""

    def __init__(self, eol: int) -> None:
        self.eod, self.vocab_size, self.eol = EOD, VOCAB, eol

    def tokenize(self, text: str) -> list[int]:
        return [self.eol] if text == "\n" else [ord(c) % VOCAB for c in text]

    def detokenize(self, ids) -> str:
        return "".join("\n" if i == self.eol else chr(i) for i in ids)


def test_stop_on_eol_and_add_bos():
    model = build_model()
    free = generate(model, None, PROMPTS[:1], NEW, greedy=True, eod_id=EOD)
    start = len(PROMPTS[0])
    eol = free["tokens"][0][start + 1]
    tok = _CharTokenizer(eol)
    out = generate(model, tok, PROMPTS[:1], NEW, greedy=True, stop_on_eol=True)
    first = start + free["tokens"][0][start:].index(eol)
    assert out["lengths"] == [first + 1] and out["text"][0].endswith("\n")
    bos = generate(model, tok, PROMPTS[:1], 3, greedy=True, add_BOS=True)
    assert bos["tokens"][0][: start + 1] == [EOD] + PROMPTS[0] and bos["lengths"] == [start + 4]
