"""Our ParallelAttention against NVIDIA megatron-core 0.16.1's SelfAttention (its local spec, DotProductAttention;
the oracle run in a subprocess) from the same weights: --qk-layernorm (RMSNorm over each head's channels before
RoPE) and --window-size / --window-attn-skip-freq (a sliding-window layer and a global one), GQA and
--kv-channels != hidden/heads: outputs and the gradients of the input, QKV, projection and q/k norm weights."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.attention import ParallelAttention
from megatron.layers.enums import AttnMaskType
from tests.mcore_oracle import ORACLE_CPU_PRELUDE, run_oracle

pytestmark = pytest.mark.slow

H, HEADS, GROUPS, HD, SEQ, BATCH = 32, 4, 2, 12, 16, 2
# name -> (layer number, window, skip freq, qk_layernorm)
CASES = {"qk_norm_window_layer": (1, [3, 0], 2, True), "qk_norm_global_layer": (2, [3, 0], 2, True),
         "window_only": (1, [5, 0], None, False)}

ORACLE_SCRIPT = ORACLE_CPU_PRELUDE + r'''
import json, os
import torch
import torch.distributed as dist
_ones = torch.ones
torch.ones = lambda *a, device=None, **k: _ones(*a, device="cpu" if device == "cuda" else device, **k)  # its masks
torch.cuda.is_available = lambda: False
if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    spec_json = json.load(open("cases.json"))
    S, cases = spec_json["sizes"], spec_json["cases"]
    for name, (layer_number, window, skip, qk) in cases.items():
        cfg = TransformerConfig(num_layers=2, hidden_size=S['H'], num_attention_heads=S['HEADS'],
                                num_query_groups=S['GROUPS'], kv_channels=S['HD'], qk_layernorm=qk,
                                normalization="RMSNorm", layernorm_epsilon=1e-6, window_size=tuple(window),
                                window_attn_skip_freq=skip, add_bias_linear=False, hidden_dropout=0.0,
                                attention_dropout=0.0, apply_rope_fusion=False, use_cpu_initialization=True,
                                masked_softmax_fusion=False)
        spec = get_gpt_layer_local_spec(qk_layernorm=qk, normalization="RMSNorm")
        attn = SelfAttention(cfg, spec.submodules.self_attention.submodules, layer_number=layer_number,
                             attn_mask_type=AttnMaskType.causal)
        W = torch.load(name + "_in.pt")
        with torch.no_grad():
            attn.linear_qkv.weight.copy_(W["qkv"])
            attn.linear_proj.weight.copy_(W["proj"])
            if qk:
                attn.q_layernorm.weight.copy_(W["qn"])
                attn.k_layernorm.weight.copy_(W["kn"])
        rope = RotaryEmbedding(kv_channels=S['HD'], rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
        emb = rope(S['SEQ'])
        x = W["x"].clone().requires_grad_(True)
        mask = torch.triu(_ones(S['SEQ'], S['SEQ'], dtype=torch.bool), diagonal=1)[None, None]
        out, _ = attn(x, mask, rotary_pos_emb=emb)
        (out * W["g"]).sum().backward()
        res = {"out": out.detach(), "dx": x.grad, "dqkv": attn.linear_qkv.weight.grad,
               "dproj": attn.linear_proj.weight.grad}
        if qk:
            res.update(dqn=attn.q_layernorm.weight.grad, dkn=attn.k_layernorm.weight.grad)
        torch.save(res, name + "_out.pt")
'''


def _weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = (HEADS + 2 * GROUPS) * HD
    return {"qkv": torch.randn(rows, H, generator=g) * 0.2, "proj": torch.randn(H, HEADS * HD, generator=g) * 0.2,
            "qn": 1 + 0.3 * torch.randn(HD, generator=g), "kn": 1 + 0.3 * torch.randn(HD, generator=g),
            "x": torch.randn(SEQ, BATCH, H, generator=g), "g": torch.randn(SEQ, BATCH, H, generator=g)}


def _ours(case: tuple, w: dict) -> dict:
    layer_number, window, skip, qk = case
    config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS, group_query_attention=True,
                               num_query_groups=GROUPS, kv_channels=HD, qk_layernorm=qk, normalization="RMSNorm",
                               layernorm_epsilon=1e-6, window_size=tuple(window), window_attn_skip_freq=skip,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               position_embedding_type="rope")
    attn = ParallelAttention(config, layer_number, attn_mask_type=AttnMaskType.causal)
    with torch.no_grad():
        attn.query_key_value.weight.copy_(w["qkv"])
        attn.dense.weight.copy_(w["proj"])
        if qk:
            attn.q_layernorm.weight.copy_(w["qn"])
            attn.k_layernorm.weight.copy_(w["kn"])
    x = w["x"].clone().requires_grad_(True)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    out, _ = attn(x, mask)
    (out * w["g"]).sum().backward()
    res = {"out": out.detach(), "dx": x.grad, "dqkv": attn.query_key_value.weight.grad,
           "dproj": attn.dense.weight.grad}
    if qk:
        res.update(dqn=attn.q_layernorm.weight.grad, dkn=attn.k_layernorm.weight.grad)
    return res


def test_attention_equals_megatron_core(tmp_path):
    weights = {name: _weights(seed) for seed, name in enumerate(CASES)}
    for name, w in weights.items():
        torch.save(w, tmp_path / f"{name}_in.pt")
    (tmp_path / "cases.json").write_text(json.dumps(
        {"sizes": dict(H=H, HEADS=HEADS, GROUPS=GROUPS, HD=HD, SEQ=SEQ), "cases": CASES}))
    run_oracle(ORACLE_SCRIPT, tmp_path)
    outs = {}
    for name, case in CASES.items():
        theirs = torch.load(tmp_path / f"{name}_out.pt")
        ours = outs[name] = _ours(case, weights[name])
        assert set(ours) == set(theirs), (name, sorted(ours), sorted(theirs))
        for key in theirs:
            diff = (ours[key] - theirs[key]).abs().max().item()
            assert diff <= 1e-5, f"{name}: {key} differs from megatron-core by {diff}"
    # the window really changed the attention: the windowed layer's output differs from the same weights' global one
    glob = _ours((2, [3, 0], 2, True), weights["qk_norm_window_layer"])
    assert (glob["out"] - outs["qk_norm_window_layer"]["out"]).abs().max() > 1e-3
