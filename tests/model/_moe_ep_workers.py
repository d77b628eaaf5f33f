"""Worker of tests/model/test_moe_expert_parallel.py (module level so `run_distributed` can pickle it)."""
from __future__ import annotations

import torch
import torch.distributed as dist

H, FFN, SEQ, BATCH, EXPERTS = 32, 48, 16, 2, 4


def _layer(kw: dict, ep_group, dispatcher: str, w: dict):
    from megatron.core.transformer_config import TransformerConfig
    from megatron.layers.moe import MoELayer

    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN, padded_vocab_size=64,
        add_bias_linear=False, swiglu=kw.get("glu", True), hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=EXPERTS, moe_router_topk=kw.get("topk", 2), moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
        moe_expert_capacity_factor=kw.get("capacity"), moe_pad_expert_input_to_capacity=kw.get("pad", False),
        moe_token_drop_policy=kw.get("policy", "probs"), moe_router_pre_softmax=kw.get("pre_softmax", False),
        moe_apply_probs_on_input=kw.get("probs_on_input", False),
        moe_shared_expert_intermediate_size=kw.get("shared"))
    layer = MoELayer(config, layer_number=1, ep_group=ep_group, dispatcher=dispatcher)
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    rank = dist.get_rank(ep_group) if ep_group is not None else 0
    n = EXPERTS // ep
    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        layer.experts.weight1.copy_(w["w1"][rank * n:(rank + 1) * n])
        layer.experts.weight2.copy_(w["w2"][rank * n:(rank + 1) * n])
        if kw.get("shared") and "shared" in w:
            for name, p in layer.shared_experts.named_parameters():
                p.copy_(w["shared"][name])
    return layer


def _run(layer, x: torch.Tensor, g: torch.Tensor) -> dict:
    from megatron.core import aux_losses

    aux_losses.clear()
    aux_losses.set_aux_loss_scale(1.0)
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * g).sum().backward()
    res = {"out": out.detach(), "dx": x.grad, "drouter": layer.router.weight.grad,
           "dw1": layer.experts.weight1.grad, "dw2": layer.experts.weight2.grad}
    res.update({"loss_" + k: v for k, v in aux_losses.tracked().items()})
    aux_losses.clear()
    return res


def oracle_case_worker(rank: int, world_size: int, w: dict) -> dict:
    """Our EP layer (alltoall) on this rank's tokens from the weights and inputs `w` of the megatron-core oracle."""
    group = dist.new_group(list(range(world_size)))
    res = _run(_layer({}, group, "alltoall", w), w["xs"][rank], w["gs"][rank])
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in res.items()}


def ep_layer_worker(rank: int, world_size: int, cases: dict) -> dict:
    """Per case and dispatcher: max |EP result - serial result| (serial: every expert on this rank; the expert
    grads of the serial runs summed over the ranks, as the expert-parallel layer's backward sums them)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(7)
    w = {"router": torch.randn(EXPERTS, H, generator=gen) * 0.3,
         "w1": torch.randn(EXPERTS, H, 2 * FFN, generator=gen) * 0.1,
         "w2": torch.randn(EXPERTS, FFN, H, generator=gen) * 0.1}
    xs = [torch.randn(SEQ, BATCH, H, generator=gen) for _ in range(world_size)]
    gs = [torch.randn(SEQ, BATCH, H, generator=gen) for _ in range(world_size)]
    group = dist.new_group(list(range(world_size)))
    out = {}
    base = w
    for name, kw in cases.items():
        w = dict(base)
        if kw.get("glu", True) is False:
            w["w1"] = w["w1"][..., :FFN].contiguous()
        if kw.get("shared"):
            ref = _layer(kw, None, "allgather", w)
            w["shared"] = {n: p.detach().clone() for n, p in ref.shared_experts.named_parameters()}
        serial = [_run(_layer(kw, None, "allgather", w), xs[r], gs[r]) for r in range(world_size)]
        n = EXPERTS // world_size
        for dispatcher in ("allgather", "alltoall"):
            mine = _run(_layer(kw, group, dispatcher, w), xs[rank], gs[rank])
            diffs = {}
            for key, value in mine.items():
                if key in ("dw1", "dw2"):
                    ref = sum(s[key] for s in serial)[rank * n:(rank + 1) * n]
                else:
                    ref = serial[rank][key]
                diffs[key] = (value - ref).abs().max().item()
            out[f"{name}/{dispatcher}"] = diffs
    return out
