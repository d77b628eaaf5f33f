"""A Megatron Core / torch_dist checkpoint loaded under --expert-tensor-parallel-size != TP
(megatron/checkpoint/formats.rank_piece): the dense weights get this rank's TP slice, the experts this rank's
expert-TP slice (whole experts with expert-TP 1 under TP 2; the TP slice when expert-TP = TP). Per-rank checkpoints
under expert-TP > 1 != TP (megatron/checkpoint/expert_shards.py) gather / slice exactly the experts' weights, fp16
optimizer moments and fp32 main params. No processes."""
from __future__ import annotations

import torch

from megatron.checkpoint.formats import rank_piece
from megatron.core.parallel_state import ParallelState
from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.layers.tp_shards import split_tensor_parallel_state_dict, tensor_parallel_layouts
from tests.model.helpers import build_gpt, tiny_config


def test_experts_split_over_the_expert_tensor_parallel_group() -> None:
    config = tiny_config(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, ffn_hidden_size=48,
                         swiglu=True)
    model = build_gpt(config)
    full = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    expert = next(k for k in full if k.endswith(".mlp.experts.weight1"))
    dense = next(k for k in full if k.endswith("self_attention.query_key_value.weight"))
    tp_split = split_tensor_parallel_state_dict(full, 2, layouts=tensor_parallel_layouts(model))
    for rank in range(2):
        same = ParallelState(tp_size=2, tp_rank=rank)  # expert-TP = TP (its default)
        etp1 = ParallelState(tp_size=2, tp_rank=rank, etp_size=1, etp_rank=0)
        piece = rank_piece(full, full, model, config.num_layers, 0, same)
        assert torch.equal(piece[expert], tp_split[rank][expert]) and piece[expert].shape != full[expert].shape
        piece = rank_piece(full, full, model, config.num_layers, 0, etp1)
        assert torch.equal(piece[expert], full[expert])  # whole experts on each TP rank
        assert torch.equal(piece[dense], tp_split[rank][dense])  # dense weights still split over TP


def test_expert_shards_reach_exactly_the_experts_in_weights_and_fp16_optimizer_state() -> None:
    """megatron/checkpoint/expert_shards.py (per-rank checkpoints under expert-TP > 1 != TP): the transform reaches
    exactly the expert stacks in the model state dict, the fp16 optimizer's Adam moments and fp32 main params, and the
    per-parameter (distributed-optimizer) state; everything else is passed through untouched; merging two shards and
    taking shard 0 again gives back the saved tensors."""
    from megatron.checkpoint import expert_shards
    from megatron.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.optimizer.distrib_optimizer import regular_state_to_param_state

    config = tiny_config(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, ffn_hidden_size=48,
                         swiglu=True)
    model = build_gpt(config).half()
    opt = get_megatron_optimizer(model, OptimizerConfig(lr=1e-3, fp16=True, initial_loss_scale=1.0))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    assert opt.step()[0]
    seen: list = []

    def whole(t: torch.Tensor, layout) -> torch.Tensor:  # two expert-TP ranks: this one and a distinct other
        seen.append(tuple(t.shape))
        return layout.merge([t, t + 1])

    def shard0(t: torch.Tensor, layout) -> torch.Tensor:
        return layout.split(t, 2)[0]

    experts = {n: p for n, p in model.named_parameters() if n.endswith(("experts.weight1", "experts.weight2"))}
    assert len(experts) == 4  # 2 MoE layers x weight1 / weight2
    sd = model.state_dict_for_save_checkpoint()
    saved = expert_shards.model_state(sd, [model], whole)
    assert len(seen) == 4
    flat, flat_saved = flatten_checkpoint_state_dict(sd), flatten_checkpoint_state_dict(saved)
    for key, value in flat.items():
        if key.endswith(("experts.weight1", "experts.weight2")):
            assert flat_saved[key].numel() == 2 * value.numel()
            assert torch.equal(flatten_checkpoint_state_dict(expert_shards.model_state(
                saved, [model], shard0))[key], value)
        else:
            assert flat_saved[key] is value
    optim_sd = opt.state_dict()
    seen.clear()
    saved_opt = expert_shards.regular_optimizer_state(optim_sd, [model], whole)
    assert len(seen) == 4 * 3  # exp_avg, exp_avg_sq and the fp32 main param of each expert stack
    back = expert_shards.regular_optimizer_state(saved_opt, [model], shard0)
    state, state_back = optim_sd["optimizer"]["state"], back["optimizer"]["state"]
    assert all(torch.equal(state[i][k], state_back[i][k]) for i in state for k in ("exp_avg", "exp_avg_sq"))
    mains = [t for g in optim_sd["fp32_from_fp16_params"] for t in g]
    mains_saved = [t for g in saved_opt["fp32_from_fp16_params"] for t in g]
    mains_back = [t for g in back["fp32_from_fp16_params"] for t in g]
    assert sum(a.numel() != b.numel() for a, b in zip(mains, mains_saved)) == 4
    assert all(torch.equal(a, b) for a, b in zip(mains, mains_back))
    per_param = regular_state_to_param_state(optim_sd, [model])
    saved_state = expert_shards.param_state(per_param, whole, [model])
    state_back = expert_shards.param_state(saved_state, shard0, [model])["chunks"][0]
    for name, entry in per_param["chunks"][0].items():
        grown = saved_state["chunks"][0][name]["exp_avg"].numel() == 2 * entry["exp_avg"].numel()
        assert grown == (name in experts), name
        assert all(torch.equal(state_back[name][k], entry[k]) for k in ("param", "exp_avg", "exp_avg_sq")), name


def test_which_saved_layouts_hold_whole_experts() -> None:
    """A checkpoint holds whole experts when saved with expert-TP != TP or with expert-TP = TP = 1; a run with
    expert-TP > 1 != TP loads only those (others are refused with one line naming convert.py)."""
    from argparse import Namespace

    from megatron.checkpoint.conversion.megatron_format import experts_stored_whole
    from megatron.checkpoint.expert_shards import saved_whole

    for tp, etp, whole in ((1, None, True), (1, 1, True), (2, None, False), (2, 2, False), (2, 1, True),
                           (1, 2, True), (2, 4, True)):
        args = Namespace(tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp)
        assert saved_whole(args) == whole, (tp, etp)
        assert experts_stored_whole(args) == (etp is not None and etp != tp), (tp, etp)
