"""The MoE router's group-limited routing and aux-loss-free expert bias (megatron/layers/moe.py), in-process:
against transformers' DeepseekV3TopkRouter and Qwen3MoeTopKRouter from the same weights (the flag mapping of
docs/moe.md), the expert-bias update after an iteration (megatron/core/step_updates.py), the bias kept fp32 and
saved, and the start-up checks of the new flags."""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron.core import step_updates
from megatron.core.transformer_config import TransformerConfig
from megatron.errors import ArgumentError
from megatron.layers.module import Float16Module
from megatron.layers.moe import TopKRouter, group_limited_topk, topk_routing
from megatron.settings.moe_checks import check_moe_values

H, TOKENS = 32, 24


def _config(**kw) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64, padded_vocab_size=64,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=8,
                moe_router_topk=4, moe_aux_loss_coeff=0.0)
    return TransformerConfig(**{**base, **kw})


def _dense(idx: torch.Tensor, values: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(idx.shape[0], experts).scatter(1, idx, values)


@pytest.mark.parametrize("n_group, topk_group, norm", [(4, 2, True), (2, 1, True), (1, 1, True)])
def test_sigmoid_groups_bias_scaling_equal_hf_deepseek_v3_router(n_group, topk_group, norm):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    topk = 2 * topk_group  # HF scores a group by its top-2: Megatron's top-(topk / group_topk)
    hf_cfg = transformers.DeepseekV3Config(hidden_size=H, n_routed_experts=8, num_experts_per_tok=topk,
                                           n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
                                           norm_topk_prob=norm)
    hf = DeepseekV3TopkRouter(hf_cfg)
    g = torch.Generator().manual_seed(n_group)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, H, generator=g) * 0.3)
        hf.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.2)
    x = torch.randn(TOKENS, H, generator=g)
    _, weights, idx = hf(x)
    groups = dict(num_groups=n_group, group_topk=topk_group) if n_group > 1 else {}
    probs, routing_map = topk_routing(x @ hf.weight.t(), topk, False, "sigmoid", 2.5,
                                      expert_bias=hf.e_score_correction_bias, **groups)
    assert torch.equal(routing_map, _dense(idx, torch.ones_like(weights), 8).bool())
    torch.testing.assert_close(probs, _dense(idx, weights, 8), rtol=1e-6, atol=1e-7)
    if n_group > 1:  # the groups really limit the choice here: without them another expert set wins
        _, free_map = topk_routing(x @ hf.weight.t(), topk, False, "sigmoid", 2.5,
                                   expert_bias=hf.e_score_correction_bias)
        assert not torch.equal(free_map, routing_map)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_router_equals_hf_qwen3_moe(norm_topk_prob):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf_cfg = transformers.Qwen3MoeConfig(hidden_size=H, num_experts=8, num_experts_per_tok=3,
                                         norm_topk_prob=norm_topk_prob)
    hf = Qwen3MoeTopKRouter(hf_cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, H, generator=g) * 0.3)
    x = torch.randn(TOKENS, H, generator=g)
    _, weights, idx = hf(x)
    # norm_topk_prob: softmax over the k chosen logits (our default); otherwise --moe-router-pre-softmax
    probs, routing_map = topk_routing(x @ hf.weight.t(), 3, not norm_topk_prob, "softmax", None)
    assert torch.equal(routing_map, _dense(idx, torch.ones_like(weights), 8).bool())
    torch.testing.assert_close(probs, _dense(idx, weights.float(), 8), rtol=1e-6, atol=1e-7)


def test_group_limited_topk_picks_only_from_the_best_groups():
    # 2 groups of 3; group 1 holds the two best experts of every token by sum of top-2
    scores = torch.tensor([[0.9, 0.1, 0.1, 0.8, 0.7, 0.0], [0.2, 0.2, 0.2, 0.5, 0.05, 0.0]])
    values, idx = group_limited_topk(scores, topk=2, num_groups=2, group_topk=1)
    assert sorted(idx[0].tolist()) == [3, 4]  # group sums 1.0 vs 1.5: expert 0 (0.9) is out
    assert sorted(idx[1].tolist()) == [3, 4]  # 0.4 vs 0.55: 0.05 is chosen over the three 0.2 of group 0
    assert torch.equal(values[0].sort().values, torch.tensor([0.7, 0.8]))


def test_expert_bias_counts_in_training_forwards_and_updates_after_the_iteration():
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.01, moe_router_num_groups=4, moe_router_group_topk=2)
    router = TopKRouter(config, layer_number=1)
    g = torch.Generator().manual_seed(3)
    x1, x2 = torch.randn(TOKENS, H, generator=g), torch.randn(TOKENS, H, generator=g)
    _, map1 = router(x1, TOKENS, 1)
    _, map2 = router(x2, TOKENS, 1)
    with torch.no_grad():
        router(x1, TOKENS, 1)  # evaluation: not counted
    counts = (map1.sum(0) + map2.sum(0)).float()
    assert torch.equal(router.local_tokens_per_expert, counts)
    step_updates.apply_step_updates([torch.nn.ModuleList([router])], groups=(None,))
    expected = 0.01 * torch.sign(counts.mean() - counts)
    assert torch.equal(router.expert_bias, expected) and expected.abs().sum() > 0
    assert torch.equal(router.local_tokens_per_expert, torch.zeros(8))
    # the bias changes the selection, not the weights: the chosen experts' probs are the plain sigmoid scores
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([5.0, 5.0, 5.0, 5.0, 0.0, 0.0, 0.0, 0.0]))
        probs, routing_map = router(x1, TOKENS, 1)
    assert routing_map[:, :4].all()
    scores = torch.sigmoid(x1 @ router.weight.t())[:, :4]
    torch.testing.assert_close(probs[:, :4], scores / scores.sum(-1, keepdim=True))


def test_no_expert_bias_declares_no_update():
    router = TopKRouter(_config(moe_router_score_function="sigmoid"), layer_number=1)
    router(torch.randn(TOKENS, H), TOKENS, 1)
    assert router.expert_bias is None and step_updates.declaring_modules([router]) == []
    assert "expert_bias" not in router.state_dict()


def test_expert_bias_stays_fp32_and_is_saved_without_the_counts():
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    model = Float16Module(torch.nn.ModuleList([TopKRouter(config, layer_number=1)]), torch.bfloat16)
    router = model.module[0]
    router(torch.randn(TOKENS, H).bfloat16(), TOKENS, 1)
    state = model.state_dict()
    (key,) = [k for k in state if k.endswith("expert_bias")]
    assert key.endswith("0.expert_bias") and state[key].dtype == torch.float32
    assert not any("local_tokens_per_expert" in k for k in state)
    assert router.local_tokens_per_expert.dtype == torch.float32 and router.local_tokens_per_expert.sum() == 4 * TOKENS


def _args(**kw) -> argparse.Namespace:
    base = dict(num_experts=8, moe_router_topk=4, expert_model_parallel_size=1, expert_tensor_parallel_size=None,
                moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=None, moe_layer_freq=1, num_layers=2,
                moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False, moe_aux_loss_coeff=0.0,
                moe_z_loss_coeff=None, moe_router_topk_scaling_factor=None, moe_router_num_groups=None,
                moe_router_group_topk=None, moe_router_enable_expert_bias=False, moe_router_score_function="sigmoid",
                moe_router_bias_update_rate=1e-3, moe_router_load_balancing_type="aux_loss")
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, named", [
    (dict(moe_router_num_groups=4), "--moe-router-group-topk"),
    (dict(moe_router_group_topk=2), "--moe-router-num-groups"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "must divide --num-experts"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=5), "must be between 1 and --moe-router-num-groups"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=3, moe_router_topk=2), "--moe-router-topk (2)"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=3), "--moe-router-topk (3)"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
    (dict(moe_router_enable_expert_bias=True, moe_router_score_function="softmax"), "sigmoid"),
    (dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=float("nan")), "--moe-router-bias-update"),
])
def test_router_flags_are_checked_at_start_up_with_one_line(kw, named):
    with pytest.raises(ArgumentError) as info:
        check_moe_values(_args(**kw))
    assert named in str(info.value) and "\n" not in str(info.value)


def test_router_config_checks_as_megatron_core():
    check_moe_values(_args(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_enable_expert_bias=True))
    with pytest.raises(ValueError, match="sigmoid"):
        _config(moe_router_enable_expert_bias=True)
    with pytest.raises(ValueError, match="must divide"):
        _config(moe_router_num_groups=3, moe_router_group_topk=1)
