"""GPT-OSS's parts (issue #38) in-process: attention sinks (--softmax-type) in KV-cache decoding and the softmax
formula, the clamped offset GLU (--quick-geglu, --glu-linear-offset, --activation-func-clamp-value) against its
formula, and the flags reaching TransformerConfig."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.arguments import core_transformer_config_from_args, parse_args
from megatron.layers import InferenceParams, mcore_names
from megatron.layers.fused_softmax import softmax_with_sink
from megatron.layers.mlp import ParallelMLP, activation_for
from megatron.layers.moe import MoELayer
from tests.model.helpers import batch, build_gpt, tiny_config

transformers = pytest.importorskip("transformers")
modeling_gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")


def test_softmax_with_sink_is_softmax_with_an_extra_logit():
    g = torch.Generator().manual_seed(0)
    scores, sink = torch.randn(2, 3, 4, 5, generator=g), torch.randn(3, generator=g)
    expected = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sink.exp().view(1, 3, 1, 1))
    torch.testing.assert_close(softmax_with_sink(scores, sink), expected)
    off_by_one = softmax_with_sink(scores, torch.zeros(3))
    torch.testing.assert_close(off_by_one.sum(-1), 1 - 1 / (scores.exp().sum(-1) + 1))


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_sinks_kv_cache_decoding_matches_full_forward(softmax_type):
    model = build_gpt(tiny_config(softmax_type=softmax_type, group_query_attention=True, num_query_groups=2,
                                  position_embedding_type="rope")).eval()
    sinks = [n for n, _ in model.named_parameters() if n.endswith("softmax_offset")]
    assert len(sinks) == (2 if softmax_type == "learnable" else 0)
    ids, pos, mask, _ = batch()
    with torch.no_grad():
        full = model(ids, pos, mask)
        vanilla = build_gpt(tiny_config(group_query_attention=True, num_query_groups=2,
                                        position_embedding_type="rope")).eval()(ids, pos, mask)
        params = InferenceParams(max_batch_size=2, max_sequence_length=8)
        outs = [model(ids[:, :5], pos[:, :5], mask[..., :5, :5], inference_params=params)]
        params.sequence_len_offset = 5
        for t in range(5, 8):
            outs.append(model(ids[:, t:t + 1], pos[:, t:t + 1], mask, inference_params=params))
            params.sequence_len_offset += 1
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-5, atol=1e-5)
    assert (full - vanilla).abs().max() > 1e-3


def test_clamped_quick_geglu_formula():
    config = tiny_config(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0)
    name, act = activation_for(config)
    assert name == "quick_geglu"
    x = torch.randn(3, 10) * 10
    gate, up = x[:, :5].clamp(max=7.0), x[:, 5:].clamp(-7.0, 7.0)
    torch.testing.assert_close(act(x), gate * torch.sigmoid(1.702 * gate) * (up + 1.0))
    name, act = activation_for(tiny_config(swiglu=True, activation_func_clamp_value=2.0))
    assert name == "swiglu_clamped"
    torch.testing.assert_close(act(x), F.silu(x[:, :5].clamp(max=2.0)) * x[:, 5:].clamp(-2.0, 2.0))
    mlp = ParallelMLP(config)
    assert mlp.dense_h_to_4h.weight.shape[0] == 2 * config.ffn_hidden_size  # gated: [gate; up]


def test_gpt_oss_config_refusals():
    with pytest.raises(ValueError, match="--softmax-type"):
        tiny_config(softmax_type="sink")
    with pytest.raises(ValueError, match="need a gated MLP"):
        tiny_config(glu_linear_offset=1.0)
    with pytest.raises(ValueError, match="choose one MLP activation"):
        tiny_config(quick_geglu=True, swiglu=True)
    with pytest.raises(ValueError, match="context parallelism"):
        tiny_config(softmax_type="learnable", context_parallel_size=2)


def test_flags_reach_transformer_config():
    args = parse_args(args=[
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--softmax-type", "learnable",
        "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0"])
    config = core_transformer_config_from_args(args)
    assert (config.softmax_type, config.quick_geglu, config.glu_linear_offset, config.activation_func_clamp_value) \
        == ("learnable", True, 1.0, 7.0)


def _hf_gpt_oss_mlp(h: int, f: int, experts: int, topk: int):
    hf_config = transformers.GptOssConfig(hidden_size=h, intermediate_size=f, num_local_experts=experts,
                                          num_experts_per_tok=topk, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8, num_hidden_layers=1, vocab_size=64)
    mlp = modeling_gpt_oss.GptOssMLP(hf_config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return mlp


def test_moe_with_biases_and_clamped_glu_equals_hf_gpt_oss_mlp():
    h, f, experts, topk = 16, 12, 4, 2
    hf = _hf_gpt_oss_mlp(h, f, experts, topk)
    config = tiny_config(hidden_size=h, ffn_hidden_size=f, num_moe_experts=experts, moe_router_topk=topk,
                         quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                         add_bias_linear=True, moe_aux_loss_coeff=0.0)
    ours = MoELayer(config)
    gate_up, gate_up_bias = hf.experts.gate_up_proj.detach(), hf.experts.gate_up_proj_bias.detach()
    with torch.no_grad():  # HF interleaves gate and up columns; ours holds [gate | up]
        ours.router.weight.copy_(hf.router.weight)
        ours.router.bias.copy_(hf.router.bias)
        ours.experts.weight1.copy_(torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1))
        ours.experts.bias1.copy_(torch.cat([gate_up_bias[..., ::2], gate_up_bias[..., 1::2]], dim=-1))
        ours.experts.weight2.copy_(hf.experts.down_proj)
        ours.experts.bias2.copy_(hf.experts.down_proj_bias)
    x = torch.randn(5, 2, h, generator=torch.Generator().manual_seed(4)) * 3
    expected = hf(x.transpose(0, 1))[0].transpose(0, 1)
    got, _ = ours(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert {n for n, _ in ours.named_parameters()} >= {"router.bias", "experts.bias1", "experts.bias2"}


def test_core_names_of_the_sinks_and_router_bias():
    for name in ("self_attention.core_attention.softmax_offset", "mlp.router.bias"):
        assert mcore_names.core_layer_suffix_to_ours(name, name) == name
        assert mcore_names.our_layer_suffix_to_core(name, fused_norms=True) == name
