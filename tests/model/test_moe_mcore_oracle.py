"""Our MoE layer against NVIDIA megatron-core 0.16.1's MoELayer (the oracle, run in a subprocess) from the same
weights: layer output, input/weight gradients, load-balancing loss and z-loss, the router's probs and routing map,
for top-1/top-2, capacity dropping (probs and position policies, pad to capacity), pre-softmax and sigmoid routing,
GeLU experts, a gated shared expert, group-limited routing (softmax, pre-softmax, sigmoid) and the aux-loss-free
expert bias with its values after 3 updates. The oracle runs on CPU with stand-ins for its CUDA-only calls (see ORACLE_SCRIPT)."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.core import aux_losses, step_updates
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.moe import MoELayer
from tests.mcore_oracle import run_oracle

pytestmark = pytest.mark.slow

H, FFN, SEQ, BATCH = 32, 48, 16, 2
BASE = dict(experts=4, topk=2, aux=0.01, z=1e-3, capacity=None, policy="probs", pad=False, pre_softmax=False,
            score="softmax", scaling=None, shared=None, gate=False, lb="aux_loss", glu=True, groups=None,
            group_topk=None, bias=False)
CASES = {
    "top2_swiglu": {},
    "top1_gelu": dict(topk=1, glu=False, pre_softmax=True),
    "top2_capacity_probs": dict(capacity=0.5),
    "top2_capacity_position_pad": dict(capacity=0.75, policy="position", pad=True),
    "top1_capacity_pad": dict(topk=1, capacity=1.0, pad=True, pre_softmax=True),
    "top2_shared_gate_presoftmax": dict(shared=40, gate=True, pre_softmax=True, scaling=2.0),
    "top2_sigmoid_seq_aux": dict(score="sigmoid", lb="seq_aux_loss", shared=40),
    # DeepSeek-V3's router: sigmoid, group-limited, expert bias (and its update after 3 iterations), scaling
    "top4_sigmoid_groups_bias_scaling": dict(experts=8, topk=4, score="sigmoid", groups=4, group_topk=2, bias=True,
                                             scaling=2.5),
    "top2_sigmoid_bias": dict(experts=8, score="sigmoid", bias=True, aux=0.0),
    "top2_softmax_groups": dict(experts=8, groups=4, group_topk=2),
    "top2_presoftmax_groups_scaling": dict(experts=8, groups=2, group_topk=1, pre_softmax=True, scaling=1.5),
}
RATE = 0.01  # --moe-router-bias-update-rate of the bias cases

# Stand-ins: torch.cuda.current_device -> "cpu", the RNG tracker's fork -> no-op, te_general_gemm unset; the
# allgather dispatcher; no linear bias. Runs every case in one process (importing megatron-core is slow).
ORACLE_SCRIPT = r'''
import contextlib, json, os
import torch
import torch.distributed as dist
import torch.nn.functional as F
torch.cuda.current_device = lambda: "cpu"
torch.cuda.is_available = lambda: False
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(1, 1)
import megatron.core.tensor_parallel.random as rnd

class _Tracker:
    def fork(self, *a, **k): return contextlib.nullcontext()
    def add(self, *a, **k): pass
    def get_states(self): return {}
    def is_initialized(self): return True

rnd.get_cuda_rng_tracker = lambda *a, **k: _Tracker()
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe import moe_utils
moe_utils.te_general_gemm = None

cases = json.load(open("cases.json"))
for name, kw in cases.items():
    cfg = TransformerConfig(
        num_layers=1, hidden_size=kw["hidden"], num_attention_heads=4, ffn_hidden_size=kw["ffn"],
        num_moe_experts=kw["experts"], moe_router_topk=kw["topk"], moe_aux_loss_coeff=kw["aux"],
        moe_z_loss_coeff=kw["z"], moe_expert_capacity_factor=kw["capacity"], moe_token_drop_policy=kw["policy"],
        moe_pad_expert_input_to_capacity=kw["pad"], moe_router_pre_softmax=kw["pre_softmax"],
        moe_router_score_function=kw["score"], moe_router_topk_scaling_factor=kw["scaling"],
        moe_shared_expert_intermediate_size=kw["shared"], moe_shared_expert_gate=kw["gate"],
        moe_router_load_balancing_type=kw["lb"], gated_linear_unit=kw["glu"],
        moe_router_num_groups=kw["groups"], moe_router_group_topk=kw["group_topk"],
        moe_router_enable_expert_bias=kw["bias"], moe_router_bias_update_rate=kw["rate"],
        activation_func=F.silu if kw["glu"] else F.gelu, add_bias_linear=False,
        moe_token_dispatcher_type="allgather", use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0)
    spec = get_moe_module_spec(use_te=False, num_experts=kw["experts"], moe_grouped_gemm=False)
    layer = MoELayer(cfg, spec.submodules, layer_number=1)
    W = torch.load(name + "_in.pt")
    with torch.no_grad():
        layer.router.weight.copy_(W["router"])
        for i, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(W["fc1"][i])
            expert.linear_fc2.weight.copy_(W["fc2"][i])
        if kw["shared"]:
            layer.shared_experts.linear_fc1.weight.copy_(W["shared_fc1"])
            layer.shared_experts.linear_fc2.weight.copy_(W["shared_fc2"])
            if kw["gate"]:
                layer.shared_experts.gate_weight.copy_(W["gate"])
        if kw["bias"]:
            layer.router.expert_bias.copy_(W["bias"])
    x = W["x"].clone().requires_grad_(True)
    layer.train()
    layer.router.set_layer_number(1)
    with torch.no_grad():  # the router alone (no grad: no token counting)
        probs, routing_map = layer.router(W["x"])
    moe_utils.clear_aux_losses_tracker()
    out, _ = layer(x)
    (out * W["g"]).sum().backward()
    experts = layer.experts.local_experts
    res = {"out": out.detach(), "dx": x.grad, "drouter": layer.router.weight.grad,
           "dfc1": torch.stack([e.linear_fc1.weight.grad for e in experts]),
           "dfc2": torch.stack([e.linear_fc2.weight.grad for e in experts])}
    if kw["shared"]:
        res["dshared_fc1"] = layer.shared_experts.linear_fc1.weight.grad
        if kw["gate"]:
            res["dgate"] = layer.shared_experts.gate_weight.grad
    for key, value in moe_utils.get_moe_layer_wise_logging_tracker().items():
        if value["values"][0] != 0:  # the tracker keeps (zeroed) names of earlier cases
            res["loss_" + key] = value["values"][0].clone()
    res["probs"], res["map"] = probs, routing_map.float()
    if kw["bias"]:  # 3 iterations: the update after each (finalize_model_grads), then another training forward
        from megatron.core.distributed.finalize_model_grads import (
            _update_router_expert_bias, reset_model_temporary_tensors)
        steps = []
        for i in range(3):
            _update_router_expert_bias([layer], cfg)
            reset_model_temporary_tensors(cfg, [layer])
            steps.append(layer.router.expert_bias.clone())
            if i < 2:
                layer(W["x"] * (i + 2))
        res["bias_steps"] = torch.stack(steps)
    torch.save(res, name + "_out.pt")
'''


def _weights(kw: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    e, blocks = kw["experts"], 2 if kw["glu"] else 1
    w = {"router": torch.randn(e, H, generator=g) * 0.3, "fc1": torch.randn(e, blocks * FFN, H, generator=g) * 0.1,
         "fc2": torch.randn(e, H, FFN, generator=g) * 0.1, "x": torch.randn(SEQ, BATCH, H, generator=g),
         "g": torch.randn(SEQ, BATCH, H, generator=g)}
    if kw["bias"]:
        w["bias"] = torch.randn(e, generator=g) * 0.05
    if kw["shared"]:
        w["shared_fc1"] = torch.randn(2 * kw["shared"], H, generator=g) * 0.1
        w["shared_fc2"] = torch.randn(H, kw["shared"], generator=g) * 0.1
        w["gate"] = torch.randn(1, H, generator=g) * 0.1
    return w


def _ours(kw: dict, w: dict) -> dict:
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN, padded_vocab_size=64,
        add_bias_linear=False, swiglu=kw["glu"], hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=kw["experts"], moe_router_topk=kw["topk"], moe_aux_loss_coeff=kw["aux"],
        moe_z_loss_coeff=kw["z"], moe_expert_capacity_factor=kw["capacity"], moe_token_drop_policy=kw["policy"],
        moe_pad_expert_input_to_capacity=kw["pad"], moe_router_pre_softmax=kw["pre_softmax"],
        moe_router_score_function=kw["score"], moe_router_topk_scaling_factor=kw["scaling"],
        moe_shared_expert_intermediate_size=kw["shared"], moe_shared_expert_gate=kw["gate"],
        moe_router_load_balancing_type=kw["lb"], moe_router_num_groups=kw["groups"],
        moe_router_group_topk=kw["group_topk"], moe_router_enable_expert_bias=kw["bias"],
        moe_router_bias_update_rate=kw["rate"])
    layer = MoELayer(config, layer_number=1)
    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        layer.experts.weight1.copy_(w["fc1"].transpose(1, 2))
        layer.experts.weight2.copy_(w["fc2"].transpose(1, 2))
        if kw["shared"]:
            layer.shared_experts.dense_h_to_4h.weight.copy_(w["shared_fc1"])
            layer.shared_experts.dense_4h_to_h.weight.copy_(w["shared_fc2"])
            if kw["gate"]:
                layer.shared_experts.gate_weight.copy_(w["gate"])
        if kw["bias"]:
            layer.router.expert_bias.copy_(w["bias"])
        probs, routing_map = layer.router(w["x"].reshape(-1, H), SEQ, BATCH)
    aux_losses.clear()
    aux_losses.set_aux_loss_scale(1.0)
    x = w["x"].clone().requires_grad_(True)
    out, _ = layer(x)
    (out * w["g"]).sum().backward()
    res = {"out": out.detach(), "dx": x.grad, "drouter": layer.router.weight.grad,
           "dfc1": layer.experts.weight1.grad.transpose(1, 2), "dfc2": layer.experts.weight2.grad.transpose(1, 2)}
    if kw["shared"]:
        res["dshared_fc1"] = layer.shared_experts.dense_h_to_4h.weight.grad
        if kw["gate"]:
            res["dgate"] = layer.shared_experts.gate_weight.grad
    for key, values in aux_losses.tracked().items():
        res["loss_" + key] = values[0]
    aux_losses.clear()
    res["probs"], res["map"] = probs, routing_map.float()
    if kw["bias"]:
        steps = []
        for i in range(3):
            step_updates.apply_step_updates([layer], groups=())
            steps.append(layer.router.expert_bias.clone())
            if i < 2:
                layer(w["x"] * (i + 2))
        aux_losses.clear()
        res["bias_steps"] = torch.stack(steps)
    return res


def test_moe_layer_equals_megatron_core(tmp_path):
    cases = {name: {**BASE, **over, "hidden": H, "ffn": FFN, "rate": RATE} for name, over in CASES.items()}
    weights = {name: _weights(kw, seed) for seed, (name, kw) in enumerate(cases.items())}
    for name, w in weights.items():
        torch.save(w, tmp_path / f"{name}_in.pt")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run_oracle(ORACLE_SCRIPT, tmp_path)
    for name, kw in cases.items():
        theirs = torch.load(tmp_path / f"{name}_out.pt")
        ours = _ours(kw, weights[name])
        assert set(ours) == set(theirs), (name, sorted(ours), sorted(theirs))
        for key in theirs:
            diff = (ours[key] - theirs[key]).abs().max().item()
            assert diff <= 1e-5, f"{name}: {key} differs from megatron-core by {diff}"
        if kw["bias"]:  # each update moves an expert's bias by +-rate (0: exactly the mean count)
            moved = (theirs["bias_steps"] - torch.cat([weights[name]["bias"][None], theirs["bias_steps"][:-1]])).abs()
            assert (moved > 0).sum(dim=1).min() >= 4, name
            assert ((moved - RATE).abs() < 1e-7).logical_or(moved == 0).all(), name
        if kw["capacity"] and not kw["pad"]:  # the case really drops tokens
            assert (theirs["out"] == 0).all(dim=-1).any() or kw["shared"], name
