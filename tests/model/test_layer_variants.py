"""The layer variants the config selects (norms, activations, biases, positions, GQA, layer spec, pipe parts) and
the one-line refusals of impossible combinations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer_config import TransformerConfig
from megatron.layers import Float16Module
from megatron.layers.enums import AttnMaskType
from megatron.layers.layer_specs import TransformerLayerSpec, transformer_layer_spec
from megatron.layers.mlp import ParallelMLP, activation_for
from megatron.layers.norms import RMSNorm, build_norm
from megatron.layers.rotary import RotaryEmbedding, apply_rotary_pos_emb
from megatron.layers.transformer import ParallelTransformerLayer
from megatron.layers.utils import gelu_impl
from megatron.models.gpt.layer_spec import gpt_layer_spec
from megatron.models.gpt.model_pipe import FinalLayerNormPipe, ParallelTransformerLayerPipe
from tests.model.helpers import batch, build_gpt, tiny_config

LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
             group_query_attention=True, num_query_groups=2, share_embeddings_and_output_weights=False,
             ffn_hidden_size=40, init_method_std=0.1)


@pytest.mark.parametrize("kwargs,message", [
    (dict(normalization="BatchNorm"), "--normalization"),
    (dict(normalization="RMSNorm", apply_layernorm_1p=True), "--apply-layernorm-1p"),
    (dict(swiglu=True, squared_relu=True), "--squared-relu and --swiglu"),
    (dict(position_embedding_type="xpos"), "--position-embedding-type"),
    (dict(glu_activation="bilinear"), "--glu-activation"),
    (dict(glu_activation="geglu", openai_gelu=True), "--openai-gelu and --glu-activation"),
    (dict(rotary_percent=1.5), "--rotary-percent"),
    (dict(rotary_percent=0.0), "--rotary-percent"),
    (dict(position_embedding_type="rope", rotary_percent=0.1), "rotary dimension"),
    (dict(group_query_attention=True, num_query_groups=3), "must divide --num-attention-heads"),
    (dict(group_query_attention=True, num_query_groups=2, tensor_model_parallel_size=4),
     "divisible by --tensor-model-parallel-size"),
    (dict(num_query_groups=2), "needs --group-query-attention"),
])
def test_impossible_combinations_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        tiny_config(**kwargs)
    assert "\n" not in str(info.value)


def test_num_query_groups_resolution():
    assert tiny_config().num_query_groups == 4
    assert tiny_config(group_query_attention=True).num_query_groups == 1  # Megatron-LM's default: multi-query
    assert tiny_config(position_embedding_type="rope", rotary_percent=0.5).rotary_dim == 4


def test_rmsnorm_and_layernorm_1p():
    x = torch.randn(3, 2, 32)
    norm = build_norm(tiny_config(normalization="RMSNorm", layernorm_epsilon=1e-6))
    assert isinstance(norm, RMSNorm) and [n for n, _ in norm.named_parameters()] == ["weight"]
    with torch.no_grad():
        norm.weight.normal_()
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), ref)
    ln = build_norm(tiny_config(apply_layernorm_1p=True))
    assert torch.equal(ln.weight, torch.zeros(32))  # zero-centred gamma
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    torch.testing.assert_close(ln(x), F.layer_norm(x, (32,), ln.weight + 1, ln.bias, 1e-5))


@pytest.mark.parametrize("flags,name", [
    (dict(), "gelu_tanh"),
    (dict(bias_gelu_fusion=False), "gelu"),
    (dict(add_bias_linear=False), "gelu"),  # no bias: no bias-gelu fusion (Megatron), erf GeLU
    (dict(openai_gelu=True), "openai_gelu"),
    (dict(squared_relu=True), "squared_relu"),
    (dict(swiglu=True), "swiglu"),
])
def test_activation_selection_and_maths(flags, name):
    config = tiny_config(**flags)
    assert activation_for(config)[0] == name
    mlp = ParallelMLP(config)
    x = torch.randn(5, 2, 32)
    h = x @ mlp.dense_h_to_4h.weight.t()
    if mlp.dense_h_to_4h.bias is not None:
        h = h + mlp.dense_h_to_4h.bias
    if name == "swiglu":
        assert mlp.dense_h_to_4h.weight.shape == (2 * config.ffn_hidden_size, 32)
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up
    else:
        act = {"gelu_tanh": gelu_impl, "gelu": F.gelu, "openai_gelu": gelu_impl,
               "squared_relu": lambda t: F.relu(t) ** 2}[name](h)
    out, bias = mlp(x)
    ref = act @ mlp.dense_4h_to_h.weight.t()
    torch.testing.assert_close(out, ref)
    assert (bias is None) == (not config.add_bias_linear)


def test_biases_follow_add_bias_linear_and_add_qkv_bias():
    names = {n for n, _ in build_gpt(tiny_config(add_bias_linear=False, add_qkv_bias=True)).named_parameters()}
    biases = {n.split("layers.0.")[-1] for n in names if n.endswith("bias") and "layers.0." in n}
    assert biases == {"input_layernorm.bias", "post_attention_layernorm.bias", "self_attention.query_key_value.bias"}


def test_rope_partial_and_decode_offset():
    rot = RotaryEmbedding(4, base=500.0)
    t = torch.randn(6, 2, 3, 8)
    cos, sin = rot.cos_sin(6, 0, t.device, t.dtype)
    out = apply_rotary_pos_emb(t, cos, sin)
    assert torch.equal(out[..., 4:], t[..., 4:])  # channels past the rotary dimension pass through
    # position p of the first half-pair rotates by angle p * base^0 = p
    angle = torch.arange(6.0)
    x1, x2 = t[..., 0], t[..., 2]
    torch.testing.assert_close(out[..., 0], x1 * angle.cos()[:, None, None] - x2 * angle.sin()[:, None, None])
    cos2, sin2 = rot.cos_sin(2, 4, t.device, t.dtype)  # decode offset 4: the same rows of the table
    torch.testing.assert_close(apply_rotary_pos_emb(t[4:], cos2, sin2), out[4:])


@pytest.mark.parametrize("pe", ["rope", "none"])
def test_no_position_table_and_position_ids_unused(pe):
    model = build_gpt(tiny_config(position_embedding_type=pe)).eval()
    assert not any("position_embeddings" in n for n, _ in model.named_parameters())
    assert "position_embeddings" not in model.state_dict_for_save_checkpoint()["language_model"]["embedding"]
    ids, pos, mask, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, mask), model(ids, None, mask))


def test_custom_layer_spec_swaps_one_part():
    config = tiny_config()

    class ZeroMLP(torch.nn.Module):
        def forward(self, x):
            return torch.zeros_like(x), None

    base = transformer_layer_spec(AttnMaskType.causal)
    spec = TransformerLayerSpec(input_norm=base.input_norm, self_attention=base.self_attention,
                                pre_mlp_norm=base.pre_mlp_norm, mlp=lambda c, n, g: ZeroMLP())
    layer = ParallelTransformerLayer(config, 1, spec=spec)
    assert isinstance(layer.mlp, ZeroMLP) and not any("mlp" in n for n, _ in layer.named_parameters())
    decoder = ParallelTransformerLayer(config, 1, spec=transformer_layer_spec(cross_attention=True))
    assert {"inter_attention", "post_inter_attention_layernorm"} <= {n for n, _ in decoder.named_children()}


def test_pipe_parts_are_the_gpt_parts():
    config = tiny_config(**LLAMA)
    model = build_gpt(config, seed=5).eval()
    layer = model.language_model.encoder.layers[1]
    pipe_layer = ParallelTransformerLayerPipe(config, 2, None, self_attn_mask_type=AttnMaskType.causal,
                                              spec=gpt_layer_spec(config)).eval()
    pipe_layer.load_state_dict(layer.state_dict())
    x = torch.randn(8, 2, 32)
    with torch.no_grad():
        torch.testing.assert_close(pipe_layer(x), layer(x, None))
    final = model.language_model.encoder.final_layernorm
    pipe_norm = FinalLayerNormPipe(config)
    assert list(pipe_norm.state_dict()) == ["weight"] and isinstance(final, RMSNorm)
    pipe_norm.load_state_dict(final.state_dict())
    torch.testing.assert_close(pipe_norm((x, None)), final(x))
    pipe_norm.to(torch.bfloat16)
    assert pipe_norm(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("granularity,method", [("selective", None), ("full", "uniform"), ("full", "block")])
def test_llama_recompute_equals_plain(granularity, method):
    ids, pos, mask, labels = batch()
    grads = []
    for recompute in (False, True):
        kw = dict(recompute_granularity=granularity, recompute_method=method, recompute_num_layers=1) if recompute \
            else {}
        model = build_gpt(tiny_config(**LLAMA, **kw), seed=9)
        model(ids, pos, mask, labels=labels).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_half_precision_close_to_fp32(dtype):
    config = tiny_config(**LLAMA)
    model = build_gpt(config, seed=2).eval()
    ids, pos, mask, _ = batch()
    with torch.no_grad():
        ref = model(ids, pos, mask)
        half = Float16Module(build_gpt(TransformerConfig(**{**vars(config), "bf16": dtype == torch.bfloat16,
                                                           "fp16": dtype == torch.float16}), seed=2), dtype).eval()
        out = half(ids, pos, mask)
    assert out.dtype == torch.float32 or out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_swiglu_function_bitwise_equals_autograd_of_silu_times_up():
    from megatron.layers.mlp import swiglu

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 14, generator=g, requires_grad=True)
    gy = torch.randn(5, 3, 7, generator=g)
    gate, up = torch.chunk(x, 2, dim=-1)
    ref = F.silu(gate) * up
    ref.backward(gy)
    ref_grad, x.grad = x.grad, None
    out = swiglu(x)
    out.backward(gy)
    assert torch.equal(out, ref) and torch.equal(x.grad, ref_grad)
    with torch.no_grad():
        assert torch.equal(swiglu(x), ref)


def test_rmsnorm_fp32_function_forward_bitwise_backward_equals_autograd():
    norm = RMSNorm(24, eps=1e-6)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(24, generator=g) + 0.5)
    x = torch.randn(6, 2, 24, generator=g, requires_grad=True)
    gy = torch.randn(6, 2, 24, generator=g)
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # the module's expression
    ref.backward(gy)
    ref_gx, ref_gw = x.grad, norm.weight.grad
    x.grad = norm.weight.grad = None
    out = norm(x)
    out.backward(gy)
    assert torch.equal(out, ref)
    torch.testing.assert_close(x.grad, ref_gx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm.weight.grad, ref_gw, rtol=1e-6, atol=1e-6)


def test_rotary_function_bitwise_equals_plain_expression_and_its_autograd():
    from megatron.layers.rotary import rotate_half

    rope = RotaryEmbedding(16, 500000.0)
    cos, sin = rope.cos_sin(5, 2, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(4)
    t = torch.randn(5, 2, 3, 16, generator=g, requires_grad=True)
    gy = torch.randn(5, 2, 3, 16, generator=g)
    ref = t * cos + rotate_half(t) * sin
    ref.backward(gy)
    ref_grad, t.grad = t.grad, None
    out = apply_rotary_pos_emb(t, cos, sin)
    out.backward(gy)
    assert torch.equal(out, ref) and torch.equal(t.grad, ref_grad)
