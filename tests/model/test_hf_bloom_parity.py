"""BLOOM parity with Hugging Face `BloomForCausalLM` (fp32, tiny offline configs, 16 and 12 heads): ALiBi slopes,
logits (SDPA and explicit attention, causal and left-padding masks), greedy KV-cache generation equal to HF
generate, the weight mapping round trip, and TP=2 (+SP) logits and generation equal to HF (2 gloo processes)."""
from __future__ import annotations

import pytest
import torch

from megatron.layers.alibi import AlibiBias, alibi_slopes
from megatron.models.gpt.hf_bloom import hf_bloom_config_kwargs, megatron_to_hf_bloom_state_dict
from megatron.text_generation import generate
from tests.dist_utils import run_distributed
from tests.model.hf_bloom_helpers import FAMILIES, VOCAB, causal_inputs, hf_model, megatron_twin

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33], [9, 2, 60, 40, 3, 58, 12], [10, 1, 44, 7, 7]]
NEW = 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _paths(model, sdpa: bool) -> None:
    for layer in model.language_model.encoder.layers:
        layer.self_attention.core_attention.allow_sdpa = sdpa


@pytest.mark.parametrize("heads", [1, 2, 5, 8, 12, 16, 24, 30, 64])
def test_slopes_equal_hf(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    ref = build_alibi_tensor(torch.ones(1, 4), heads, torch.float32)[:, 0, 1]  # slope * position 1
    torch.testing.assert_close(torch.tensor(alibi_slopes(heads)), ref, rtol=1e-6, atol=0)
    # each TP rank keeps its own (contiguous) heads' slopes
    halves = [AlibiBias(heads, r, 2).slopes for r in range(2)] if heads % 2 == 0 else []
    if halves:
        assert torch.equal(torch.cat(halves), AlibiBias(heads, 0, 1).slopes)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("sdpa", [True, False])
def test_logits_equal_hf(family, sdpa):
    hf = hf_model(family)
    model = megatron_twin(hf)
    _paths(model, sdpa)
    ids, pos, mask = causal_inputs()
    with torch.no_grad():
        ours, theirs = model(ids, pos, mask), hf(input_ids=ids).logits
        assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
        torch.testing.assert_close(ours, theirs, **TOL)
        torch.testing.assert_close(model(ids, pos, None), theirs, **TOL)  # no mask: the causal type's own


def test_loss_and_grads_equal_hf():
    from megatron.models.gpt.hf_bloom import hf_bloom_to_megatron_state_dict

    hf = hf_model("bloom_12_heads")
    model = megatron_twin(hf).train()
    hf.train()
    ids, pos, mask = causal_inputs()
    labels = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(9))
    ours = model(ids, pos, mask, labels=labels).mean()
    ours.backward()
    theirs = torch.nn.functional.cross_entropy(hf(input_ids=ids).logits.reshape(-1, VOCAB), labels.reshape(-1))
    theirs.backward()
    torch.testing.assert_close(ours, theirs, **TOL)
    ref = hf_bloom_to_megatron_state_dict({n: p.grad for n, p in hf.named_parameters()}, model.config)
    for name, p in model.named_parameters():  # the embedding LayerNorm included
        torch.testing.assert_close(p.grad, ref[name], **TOL, msg=name)


@pytest.mark.parametrize("sdpa", [True, False])
def test_left_padding_mask_equals_hf(sdpa):
    """HF counts ALiBi positions from the first real token; ours from 0: a per-row shift the softmax ignores."""
    hf = hf_model("bloom_12_heads", seed=4)
    model = megatron_twin(hf)
    _paths(model, sdpa)
    ids, pos, causal = causal_inputs(batch=2, seq=9)
    keep = torch.ones(2, 9, dtype=torch.long)
    keep[1, :4] = 0  # row 1 is left-padded by four tokens
    mask = causal | (keep == 0)[:, None, None, :]
    with torch.no_grad():
        ours = model(ids, pos, mask)
        theirs = hf(input_ids=ids, attention_mask=keep).logits
    real = keep.bool()
    torch.testing.assert_close(ours[real], theirs[real], **TOL)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_kv_cache_equals_hf_generate(family):
    hf = hf_model(family, seed=1)
    model = megatron_twin(hf)
    out = generate(model, None, PROMPTS, NEW, greedy=True, eod_id=VOCAB - 1,
                   use_eod_token_for_early_termination=False)
    for prompt, row in zip(PROMPTS, out["tokens"]):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert row == ref[0].tolist()
    assert len({tuple(r[3:]) for r in out["tokens"]}) == len(PROMPTS)


def test_kv_cache_equals_recompute():
    model = megatron_twin(hf_model("bloom_12_heads", seed=2))
    kw = dict(eod_id=VOCAB - 1, random_seed=5, top_k=5, return_output_log_probs=True,
              use_eod_token_for_early_termination=False)
    cached = generate(model, None, PROMPTS, NEW, use_kv_cache=True, **kw)
    recomputed = generate(model, None, PROMPTS, NEW, use_kv_cache=False, **kw)
    assert cached["tokens"] == recomputed["tokens"]
    for a, b in zip(cached["logprobs"], recomputed["logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **TOL)


def test_mapping_round_trip_is_bitwise():
    hf = hf_model("bloom_16_heads")
    model = megatron_twin(hf)
    sd = model.state_dict_for_save_checkpoint()
    assert "norm" in sd["language_model"]["embedding"]["word_embeddings"] or \
        "norm.weight" in sd["language_model"]["embedding"]["word_embeddings"]  # Megatron-DeepSpeed's key
    back = megatron_to_hf_bloom_state_dict(sd, model.config)
    ref = hf.state_dict()
    assert set(back) == set(ref)
    for k, v in back.items():
        assert torch.equal(v, ref[k]), k
    cfg = transformers.BloomConfig(**hf_bloom_config_kwargs(model.config))
    assert (cfg.n_head, cfg.n_layer, cfg.hidden_size) == (16, 2, 64)


def test_non_bloom_config_is_one_line():
    hf = hf_model("bloom_16_heads")
    with pytest.raises(ValueError, match="Hugging Face BLOOM needs --normalization LayerNorm"):
        megatron_twin(hf, normalization="RMSNorm")


def _tp2_worker(rank: int, world_size: int, refs: dict) -> list:
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.layers.tp_shards import split_tensor_parallel_state_dict
    from megatron.models.gpt.hf_bloom import hf_bloom_to_megatron_state_dict, megatron_config_from_hf_bloom
    from megatron.models.gpt.model import GPTModel

    done = []
    for family, ref in refs.items():
        hf = hf_model(family, seed=1)
        for sp in (False, True):
            state = initialize_model_parallel(tensor_model_parallel_size=2)
            try:
                config = megatron_config_from_hf_bloom(hf.config, max_position_embeddings=64,
                                                       tensor_model_parallel_size=2, sequence_parallel=sp)
                full = hf_bloom_to_megatron_state_dict(hf.state_dict(), config)
                model_parallel_manual_seed(1, state.tp_rank)
                model = GPTModel(config, pp_state=state, parallel_output=False).eval()
                model.load_state_dict(split_tensor_parallel_state_dict(full, 2, config=config)[state.tp_rank])
                ids, pos, mask = causal_inputs(seq=12)
                with torch.no_grad():
                    torch.testing.assert_close(model(ids, pos, mask), ref["logits"], **TOL)
                if not sp:
                    out = generate(model, None, PROMPTS, NEW, greedy=True, eod_id=VOCAB - 1,
                                   use_eod_token_for_early_termination=False)
                    assert out["tokens"] == ref["tokens"]
                done.append((family, sp))
            finally:
                destroy_model_parallel()
    return done


@pytest.mark.slow
def test_tp2_and_sp_equal_hf():
    refs = {}
    for family in sorted(FAMILIES):
        hf = hf_model(family, seed=1)
        ids, _, _ = causal_inputs(seq=12)
        with torch.no_grad():
            logits = hf(input_ids=ids).logits
        tokens = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))[0].tolist() for p in PROMPTS]
        refs[family] = {"logits": logits, "tokens": tokens}
    results = run_distributed(_tp2_worker, 2, args=(refs,))
    expected = [(f, sp) for f in sorted(FAMILIES) for sp in (False, True)]
    assert results == [expected, expected]
