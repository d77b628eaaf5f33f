"""Llama-family parity with Hugging Face (fp32, tiny offline configs): logits, greedy generation with the KV cache
equal to HF generate, KV cache equal to recompute, and the HF <-> Megatron weight mapping round trip."""
from __future__ import annotations

import pytest
import torch

from megatron.models.gpt.hf_llama import (
    hf_llama_config_kwargs,
    megatron_to_hf_llama_state_dict,
    qkv_pack_groups,
    qkv_unpack_groups,
)
from megatron.text_generation import generate
from tests.model.hf_llama_helpers import FAMILIES, VOCAB, causal_inputs, hf_model, megatron_twin

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33], [9, 2, 60, 40, 3, 58, 12], [10, 1, 44, 7, 7]]
NEW = 10


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_hf(family):
    hf = hf_model(family)
    model = megatron_twin(hf)
    ids, pos, mask = causal_inputs()
    with torch.no_grad():
        ours, theirs = model(ids, pos, mask), hf(input_ids=ids).logits
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama_mha", "llama_gqa", "llama_mqa_head_dim", "mistral_gqa", "qwen2_qkv_bias"])
def test_greedy_kv_cache_equals_hf_generate(family):
    hf = hf_model(family, seed=1)
    model = megatron_twin(hf)
    eod = VOCAB - 1
    out = generate(model, None, PROMPTS, NEW, greedy=True, eod_id=eod, use_eod_token_for_early_termination=False)
    for prompt, row in zip(PROMPTS, out["tokens"]):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert row == ref[0].tolist()
    assert len({tuple(r[3:]) for r in out["tokens"]}) == len(PROMPTS)


def test_kv_cache_equals_recompute_gqa():
    model = megatron_twin(hf_model("llama_gqa", seed=2))
    kw = dict(eod_id=VOCAB - 1, random_seed=5, top_k=5, return_output_log_probs=True,
              use_eod_token_for_early_termination=False)
    cached = generate(model, None, PROMPTS, NEW, use_kv_cache=True, **kw)
    recomputed = generate(model, None, PROMPTS, NEW, use_kv_cache=False, **kw)
    assert cached["tokens"] == recomputed["tokens"]
    for a, b in zip(cached["logprobs"], recomputed["logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


def test_kv_cache_holds_query_groups_not_expanded_heads():
    from megatron.layers import InferenceParams

    model = megatron_twin(hf_model("llama_gqa"))
    params = InferenceParams(2, 16)
    ids, pos, mask = causal_inputs(seq=5)
    with torch.no_grad():
        model(ids, pos, mask, inference_params=params)
    keys, values = params.key_value_memory_dict[1]
    assert keys.shape == (16, 2, 2, 8) and values.shape == (16, 2, 2, 8)  # [s, b, groups, head_dim]


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2_qkv_bias"])
def test_megatron_to_hf_round_trip(family):
    hf = hf_model(family)
    model = megatron_twin(hf)
    back = megatron_to_hf_llama_state_dict(model.state_dict_for_save_checkpoint(), model.config)
    ref = hf.state_dict()
    assert set(back) == {k for k in ref if "rotary" not in k}
    for k, v in back.items():
        assert torch.equal(v, ref[k]), k
    # and the config maps back to an equivalent HF config
    kw = hf_llama_config_kwargs(model.config)
    assert kw["num_key_value_heads"] == hf.config.num_key_value_heads
    assert kw["rope_theta"] == hf.config.rope_parameters["rope_theta"]


def test_qkv_group_layout():
    nq, ng, hd = 6, 2, 3
    q = torch.arange(nq * hd).float()
    k = 100 + torch.arange(ng * hd).float()
    v = 200 + torch.arange(ng * hd).float()
    packed = qkv_pack_groups(q, k, v, nq, ng, hd).view(ng, nq // ng + 2, hd)
    assert torch.equal(packed[1, 0], q[3 * hd: 4 * hd])  # group 1 starts with query head 3
    assert torch.equal(packed[1, 3], k[hd:])  # then its key head
    assert torch.equal(packed[0, 4], v[:hd])  # group 0 ends with its value head
    for a, b in zip(qkv_unpack_groups(packed.reshape(-1), nq, ng, hd), (q, k, v)):
        assert torch.equal(a, b)


def test_pad_vocab_and_untied_output_layer():
    hf = hf_model("llama_gqa")
    model = megatron_twin(hf, padded_vocab_size=64)
    assert model.language_model.output_layer.weight.shape == (64, 48)
    ids, pos, mask = causal_inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, mask)[..., :VOCAB], hf(input_ids=ids).logits, rtol=1e-5,
                                   atol=1e-5)
