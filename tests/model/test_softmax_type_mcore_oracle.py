"""--softmax-type (attention sinks) against NVIDIA megatron-core 0.16.1's DotProductAttention (the oracle, run in a
subprocess) from the same q, k, v and sink logits: outputs and the gradients of q, k, v and the learnable
``softmax_offset`` agree to 1e-5 for off-by-one and learnable, with grouped-query heads, under the causal mask and an
explicit padding mask."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.attention import CoreAttention
from megatron.layers.enums import AttnMaskType
from tests.mcore_oracle import ORACLE_CPU_PRELUDE, run_oracle

pytestmark = pytest.mark.slow

SQ, B, NP, NG, HN = 8, 2, 4, 2, 8
CASES = {"off_by_one_causal": ("off-by-one", "causal"), "learnable_causal": ("learnable", "causal"),
         "learnable_padding": ("learnable", "padding")}

ORACLE_SCRIPT = ORACLE_CPU_PRELUDE + r'''
import json, os
import torch
import torch.distributed as dist
if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    cases = json.load(open("cases.json"))
    for name, (softmax_type, mask_type, np_, ng, hn) in cases.items():
        cfg = TransformerConfig(num_layers=1, hidden_size=np_ * hn, num_attention_heads=np_, num_query_groups=ng,
                                softmax_type=softmax_type, attention_dropout=0.0, hidden_dropout=0.0,
                                use_cpu_initialization=True, masked_softmax_fusion=False)
        kind = AttnMaskType.causal if mask_type == "causal" else AttnMaskType.padding
        attn = DotProductAttention(cfg, layer_number=1, attn_mask_type=kind, attention_type="self")
        t = torch.load(name + "_in.pt")
        q, k, v = (t[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
        if softmax_type == "learnable":
            with torch.no_grad():
                attn.softmax_offset.copy_(t["sink"])
        out = attn(q, k, v, t["mask"], attn_mask_type=kind)
        (out * t["grad"]).sum().backward()
        res = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        if softmax_type == "learnable":
            res["dsink"] = attn.softmax_offset.grad
        torch.save(res, name + "_out.pt")
'''


def _ours(softmax_type: str, mask_type: str, t: dict) -> dict:
    config = TransformerConfig(num_layers=1, hidden_size=NP * HN, num_attention_heads=NP, group_query_attention=True,
                               num_query_groups=NG, softmax_type=softmax_type, attention_dropout=0.0,
                               hidden_dropout=0.0)
    kind = AttnMaskType.causal if mask_type == "causal" else AttnMaskType.padding
    attn = CoreAttention(config, 1, None, kind)
    q, k, v = (t[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    if softmax_type == "learnable":
        with torch.no_grad():
            attn.softmax_offset.copy_(t["sink"])
    out = attn(q, k, v, t["mask"])
    (out * t["grad"]).sum().backward()
    res = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if softmax_type == "learnable":
        res["dsink"] = attn.softmax_offset.grad
    return res


def test_softmax_type_matches_megatron_core(tmp_path):
    gen = torch.Generator().manual_seed(7)
    inputs = {}
    for name, (_softmax_type, mask_type) in CASES.items():
        if mask_type == "causal":
            mask = torch.ones(SQ, SQ, dtype=torch.bool).triu(1).view(1, 1, SQ, SQ)
        else:  # batch 1's last two keys are padding
            mask = torch.zeros(B, 1, SQ, SQ, dtype=torch.bool)
            mask[1, :, :, -2:] = True
        t = {"q": torch.randn(SQ, B, NP, HN, generator=gen), "k": torch.randn(SQ, B, NG, HN, generator=gen),
             "v": torch.randn(SQ, B, NG, HN, generator=gen), "sink": torch.randn(NP, generator=gen),
             "grad": torch.randn(SQ, B, NP * HN, generator=gen), "mask": mask}
        torch.save(t, tmp_path / f"{name}_in.pt")
        inputs[name] = t
    (tmp_path / "cases.json").write_text(json.dumps({n: [st, mt, NP, NG, HN] for n, (st, mt) in CASES.items()}))
    run_oracle(ORACLE_SCRIPT, tmp_path)
    for name, (softmax_type, mask_type) in CASES.items():
        ref = torch.load(tmp_path / f"{name}_out.pt")
        ours = _ours(softmax_type, mask_type, inputs[name])
        assert set(ours) == set(ref)
        for key in ref:
            torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=1e-5, msg=f"{name}: {key}")
        vanilla = _ours("vanilla", mask_type, inputs[name])["out"]
        assert (ours["out"] - vanilla).abs().max() > 1e-3  # the sink changes the numbers
