"""Parity with Hugging Face GPT-2: the same weights (mapped by megatron.models.gpt.hf_gpt2) give the same logits."""
from __future__ import annotations

import pytest
import torch

from megatron.models.gpt.hf_gpt2 import (
    hf_gpt2_config_kwargs,
    hf_to_megatron_gpt_state_dict,
    megatron_gpt_to_hf_state_dict,
)
from megatron.models.hf_common import qkv_hf_to_megatron, qkv_megatron_to_hf
from tests.model.helpers import batch, build_gpt, tiny_config

transformers = pytest.importorskip("transformers")


def _hf_model(config, **overrides):
    hf_config = transformers.GPT2Config(**{**hf_gpt2_config_kwargs(config), **overrides}, bos_token_id=0,
                                        eos_token_id=0)
    return transformers.GPT2LMHeadModel(hf_config).eval()


# Megatron's MLP activation per flag and the HF GPT-2 activation that computes it (the other one must not match).
GELU_FLAVOURS = [
    (dict(), "gelu_new", "gelu"),  # default --bias-gelu-fusion: Megatron's fused bias_gelu = tanh approximation
    (dict(bias_gelu_fusion=False), "gelu", "gelu_new"),  # --no-bias-gelu-fusion: erf GeLU
    (dict(openai_gelu=True), "gelu_new", "gelu"),  # --openai-gelu: tanh
    (dict(openai_gelu=True, bias_gelu_fusion=False), "gelu_new", "gelu"),
]


@pytest.mark.parametrize("flags,hf_act,wrong_act", GELU_FLAVOURS)
def test_megatron_logits_equal_hf_gpt2(flags, hf_act, wrong_act):
    # init std 0.5: pre-activations large enough that tanh and erf GeLU give different logits
    config = tiny_config(num_layers=2, layernorm_epsilon=1e-5, init_method_std=0.5, **flags)
    assert hf_gpt2_config_kwargs(config)["activation_function"] == hf_act
    model = build_gpt(config).eval()
    # non-trivial LayerNorm parameters and biases so a swapped LN weight/bias would show
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ids, pos, mask, _ = batch()
    sd = megatron_gpt_to_hf_state_dict(model.state_dict_for_save_checkpoint(), config)
    with torch.no_grad():
        ours = model(ids, pos, mask)
    for act, should_match in ((hf_act, True), (wrong_act, False)):
        hf = _hf_model(config, activation_function=act)
        missing, unexpected = hf.load_state_dict(sd, strict=False)
        assert not unexpected
        assert all(k.endswith(("attn.bias", "attn.masked_bias")) for k in missing), missing
        with torch.no_grad():
            theirs = hf(input_ids=ids).logits
        if should_match:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        else:
            assert (ours - theirs).abs().max() > 1e-3, f"{act} should differ from Megatron's {flags} MLP"


def test_layernorm_1p_maps_to_plain_layernorm():
    config = tiny_config(apply_layernorm_1p=True, init_method_std=0.2)
    model = build_gpt(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf = _hf_model(config)
    hf.load_state_dict(megatron_gpt_to_hf_state_dict(model.state_dict_for_save_checkpoint(), config), strict=False)
    ids, pos, mask, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, mask), hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    back = hf_to_megatron_gpt_state_dict(hf.state_dict(), config)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back[k], v, rtol=0, atol=1e-7, msg=k)


def test_hf_to_megatron_round_trip():
    config = tiny_config()
    hf = _hf_model(config)
    flat = hf_to_megatron_gpt_state_dict(hf.state_dict(), config)
    model = build_gpt(config, seed=3).eval()
    model.load_state_dict(flat)
    ids, pos, mask, _ = batch(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, mask), hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    back = megatron_gpt_to_hf_state_dict(model.state_dict(), config)
    for k, v in back.items():
        assert torch.equal(v, hf.state_dict()[k]), k


def test_qkv_reordering_is_head_major():
    nh, hd, h = 2, 3, 5
    # rows labelled (head, which, dim) in Megatron order
    rows = torch.arange(nh * 3 * hd).view(nh, 3, hd)
    hf_rows = qkv_megatron_to_hf(rows.reshape(-1), nh, hd).view(3, nh, hd)
    assert torch.equal(hf_rows[1, 0], rows[0, 1])  # k of head 0
    assert torch.equal(hf_rows[2, 1], rows[1, 2])  # v of head 1
    w = torch.randn(nh * 3 * hd, h)
    assert torch.equal(qkv_hf_to_megatron(qkv_megatron_to_hf(w, nh, hd), nh, hd), w)


def test_not_a_gpt_state_dict_is_rejected():
    with pytest.raises(ValueError, match="word_embeddings"):
        megatron_gpt_to_hf_state_dict({"foo": torch.zeros(1)}, tiny_config())
    with pytest.raises(ValueError, match="wte"):
        hf_to_megatron_gpt_state_dict({"foo": torch.zeros(1)}, tiny_config())
