"""The MoE layer's gather-only permutations and expert runs (megatron/layers/moe_permute.py, moe.expert_buckets).

Proof: dispatch/combine and their gradients equal index_select / index_add bitwise, with uneven rows per token
(capacity drops) and padding rows; the expert runs cover every expert once, stay one run for balanced routing; a
layer computed in many runs equals the one-run layer (outputs and every gradient) on skewed routing; the SwiGLU
experts' single autograd function (megatron/layers/moe_swiglu_experts.py) equals the per-run autograd graph bitwise.
"""
from __future__ import annotations

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.layers import moe
from megatron.layers.moe_permute import combine, dispatch, inverse_table


def test_dispatch_and_combine_equal_index_select_and_index_add_bitwise():
    g = torch.Generator().manual_seed(0)
    tokens, h = 13, 5
    targets = torch.randint(0, tokens, (29,), generator=g)  # uneven: some tokens read 0 times, some 5
    table, uneven = inverse_table(targets, tokens)
    assert uneven and table.shape == (tokens, int(torch.bincount(targets).max()))
    x = torch.randn(tokens, h, generator=g, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    rows = dispatch(x, targets, table, False, uneven)
    ref_rows = ref_x.index_select(0, targets)
    grad = torch.randn(rows.shape, generator=g)
    rows.backward(grad)
    ref_rows.backward(grad)
    assert torch.equal(rows, ref_rows) and torch.equal(x.grad, ref_x.grad)

    y = torch.randn(29, h, generator=g, requires_grad=True)
    ref_y = y.detach().clone().requires_grad_()
    out = combine(y, table, targets, uneven, False)
    ref_out = torch.zeros(tokens, h).index_add(0, targets, ref_y)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    ref_out.backward(grad)
    assert torch.equal(out, ref_out) and torch.equal(y.grad, ref_y.grad)

    # an injective map into a padded buffer: the gaps read zeros and get no gradient
    slots = torch.tensor([7, 0, 3])
    inverse = torch.full((9,), 3)
    inverse[slots] = torch.arange(3)
    src = torch.randn(3, h, generator=g, requires_grad=True)
    buf = dispatch(src, inverse, slots.view(-1, 1), True, False)
    assert torch.equal(buf[slots], src) and not buf[[1, 2, 4, 5, 6, 8]].any()
    buf.backward(torch.ones_like(buf))
    assert torch.equal(src.grad, torch.ones(3, h))


def test_expert_runs_cover_every_expert_and_split_only_skewed_routing():
    for counts in ([238, 252, 283, 254, 277, 249, 241, 254], [643, 100, 200, 300, 250, 200, 200, 155], [0] * 4, [9]):
        runs = moe.expert_buckets(counts)
        assert [first for first, _, _ in runs] == [sum(n for _, n, _ in runs[:i]) for i in range(len(runs))]
        assert sum(n for _, n, _ in runs) == len(counts)
        assert all(size == max(counts[f:f + n]) for f, n, size in runs)
    assert len(moe.expert_buckets([238, 252, 283, 254, 277, 249, 241, 254])) == 1
    skewed = moe.expert_buckets([643, 100, 200, 300, 250, 200, 200, 155])
    assert len(skewed) > 1 and sum(n * size for _, n, size in skewed) < 0.7 * 8 * 643


def test_layer_in_many_runs_equals_one_run(monkeypatch):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=6,
                               moe_ffn_hidden_size=24, moe_router_topk=2, add_bias_linear=False, swiglu=True,
                               hidden_dropout=0.0, attention_dropout=0.0, moe_aux_loss_coeff=0.01)
    torch.manual_seed(0)
    layer = moe.MoELayer(config)
    with torch.no_grad():
        layer.router.weight[2] += 1.0  # skewed routing: expert 2 gets most tokens
    x = torch.randn(20, 3, 32) * 3

    def run(split: bool):
        monkeypatch.setattr(moe, "expert_buckets", (lambda counts: [(i, 1, c) for i, c in enumerate(counts)])
                            if split else (lambda counts: [(0, len(counts), max(counts))]))
        layer.zero_grad()
        inp = x.clone().requires_grad_()
        out, _ = layer(inp)
        out.backward(torch.cos(out))
        return [out, inp.grad] + [p.grad.clone() for p in layer.parameters()]

    one, many = run(False), run(True)
    for a, b in zip(one, many):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_forward_tokens_equals_forward_between_dispatch_and_combine():
    """The fused token path (one gather into the padded groups and one back) equals the rows path bitwise, with
    capacity drops (tokens with fewer rows) and with the probabilities applied on the input."""
    for extra in ({}, {"moe_expert_capacity_factor": 0.5}, {"moe_apply_probs_on_input": True, "moe_router_topk": 1,
                                                                  "moe_router_pre_softmax": True}):
        config = TransformerConfig(**{**dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_moe_experts=4,
                                             moe_ffn_hidden_size=12, moe_router_topk=2, add_bias_linear=False,
                                             swiglu=True, hidden_dropout=0.0, attention_dropout=0.0), **extra})
        torch.manual_seed(1)
        layer = moe.MoELayer(config)
        x = torch.randn(30, 16)
        probs, routing_map = layer.router(x, 10, 3)
        expert_of_row, token_of_row = routing_map.t().nonzero(as_tuple=True)
        counts = routing_map.sum(dim=0)
        slot_of_row = torch.arange(token_of_row.numel()) - (torch.cumsum(counts, 0) - counts)[expert_of_row]
        row_probs = probs.t()[expert_of_row, token_of_row].detach()
        slots = int(counts.max())
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        fused = layer.experts.forward_tokens(xa, row_probs, token_of_row, expert_of_row, slot_of_row, slots,
                                             config.moe_apply_probs_on_input)
        table, uneven = inverse_table(token_of_row, 30)
        rows, weights = dispatch(xb, token_of_row, table, False, uneven), row_probs
        if config.moe_apply_probs_on_input:
            rows, weights = rows * row_probs.unsqueeze(-1), torch.ones_like(row_probs)
        plain = combine(layer.experts(rows, weights, expert_of_row, slot_of_row, slots), table, token_of_row,
                        uneven, False)
        grad = torch.randn_like(plain)
        fused.backward(grad)
        plain.backward(grad)
        assert torch.equal(fused, plain) and torch.equal(xa.grad, xb.grad), extra


def test_swiglu_experts_function_equals_autograd_path_bitwise(monkeypatch):
    """The SwiGLU experts as one autograd function (gradients written into one buffer per input, no concatenation)
    equal the per-run autograd graph bitwise: output and the gradients of rows, routing weights, W1 and W2, in one
    run and in several, with the weights' gradient needed or not."""
    from megatron.layers import moe_swiglu_experts

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_moe_experts=5,
                               moe_ffn_hidden_size=12, moe_router_topk=2, add_bias_linear=False, swiglu=True)
    torch.manual_seed(2)
    experts = moe.GroupedExperts(config)
    g = torch.Generator().manual_seed(3)
    for buckets in ([(0, 5, 7)], [(0, 1, 11), (1, 3, 4), (4, 1, 2)]):
        rows = sum(num * size for _, num, size in buckets)
        x, w, grad = torch.randn(rows, 16, generator=g), torch.rand(rows, generator=g), torch.randn(rows, 16, generator=g)
        for weights_grad in (True, False):
            results = []
            for fused in (True, False):
                if not fused:
                    monkeypatch.setattr(moe_swiglu_experts, "applies", lambda *a: False)
                experts.zero_grad(set_to_none=True)
                xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_(weights_grad)
                out = experts.compute(xi, wi, buckets)
                assert ("SwiGLUExperts" in out.grad_fn.name()) == fused
                out.backward(grad)
                results.append([out, xi.grad, wi.grad, experts.weight1.grad, experts.weight2.grad])
                monkeypatch.undo()
            for a, b in zip(*results):
                assert (a is None and b is None) or torch.equal(a, b), (buckets, weights_grad)
