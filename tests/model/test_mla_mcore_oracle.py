"""Our multi-latent attention against NVIDIA megatron-core 0.16.1's MLASelfAttention (its local, non-Transformer-
Engine spec with q/kv layer norms; the oracle runs in a subprocess) from the same weights: the layer output and the
gradients of the input and of every weight, with and without --q-lora-rank (DeepSeek-V2-Lite has none). The local
spec's DotProductAttention takes no separate k/v head dims in 0.16.1 (MLA runs on Transformer Engine's there), so
the oracle's core attention is a stand-in: causal softmax(q k^T * softmax_scale) v with the scale MLA passes it;
projections, norms, decoupled RoPE and the output projection are megatron-core's."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.models.deepseek.mla import MLASelfAttention
from tests.mcore_oracle import ORACLE_CPU_PRELUDE, run_oracle

pytestmark = pytest.mark.slow

H, HEADS, SEQ, BATCH = 32, 4, 12, 2
CASES = {
    "q_lora": dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6),
    "no_q_lora": dict(q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8),
    # DeepSeek-V3's YaRN (factor 40, mscale = mscale_all_dim = 1) over a short original context
    "yarn": dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=6,
                 rope_type="yarn", rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                 original_max_position_embeddings=8),
}
PLAIN_ROPE = dict(rope_type="rope")

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
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    multi_latent_attention.HAVE_TE = False  # its TE stand-ins are not types without Transformer Engine

    class CoreAttention(torch.nn.Module):  # the stand-in: causal softmax(q k^T * scale) v
        def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                     k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
            super().__init__()
            self.scale = softmax_scale

        def forward(self, q, k, v, attention_mask, attn_mask_type=None, packed_seq_params=None, **kw):
            assert attention_mask is None
            scores = torch.einsum("sbnd,tbnd->bnst", q, k) * self.scale
            causal = torch.ones(q.size(0), k.size(0), dtype=torch.bool).triu(1)
            probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
            ctx = torch.einsum("bnst,tbnd->sbnd", probs, v)
            return ctx.reshape(ctx.size(0), ctx.size(1), -1)

    cases = json.load(open("cases.json"))
    for name, kw in cases.items():
        cfg = MLATransformerConfig(
            num_layers=1, hidden_size=kw["hidden"], num_attention_heads=kw["heads"], add_bias_linear=False,
            normalization="RMSNorm", qk_layernorm=True, layernorm_epsilon=1e-5, rotary_base=10000,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, apply_rope_fusion=False,
            **{k: v for k, v in kw.items() if k not in ("hidden", "heads")})
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = CoreAttention
        attn = build_module(spec.submodules.self_attention, config=cfg, layer_number=1)
        W = torch.load(name + "_in.pt")
        missing, unexpected = attn.load_state_dict(W["weights"], strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
        x = W["x"].clone().requires_grad_(True)
        out, bias = attn(x, attention_mask=None)
        assert bias is None
        (out * W["g"]).sum().backward()
        grads = {k: p.grad for k, p in attn.named_parameters()}
        torch.save({"out": out.detach(), "dx": x.grad, "grads": grads}, name + "_out.pt")
'''

OURS: dict = {}  # our names are Core's


def _config(kw: dict) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS, add_bias_linear=False,
                             normalization="RMSNorm", qk_layernorm=True, multi_latent_attention=True,
                             position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0, **kw)


def _inputs(kw: dict, seed: int) -> dict:
    torch.manual_seed(seed)
    layer = MLASelfAttention(_config(kw), 1)
    weights = {}
    for name, p in layer.state_dict().items():
        value = torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0)
        weights[{v: k for k, v in OURS.items()}.get(name, name)] = value
    return {"weights": weights, "x": torch.randn(SEQ, BATCH, H), "g": torch.randn(SEQ, BATCH, H)}


def test_mla_matches_megatron_core(tmp_path) -> None:
    inputs = {name: _inputs(kw, seed) for seed, (name, kw) in enumerate(CASES.items())}
    for name, data in inputs.items():
        torch.save(data, tmp_path / f"{name}_in.pt")
    core = {n: {**PLAIN_ROPE, "rotary_scaling_factor": 1.0, **kw, "hidden": H, "heads": HEADS} for n, kw in CASES.items()}
    (tmp_path / "cases.json").write_text(json.dumps(core))
    run_oracle(ORACLE_SCRIPT, tmp_path)
    for name, kw in CASES.items():
        data = inputs[name]
        layer = MLASelfAttention(_config(kw), 1)
        layer.load_state_dict({OURS.get(k, k): v for k, v in data["weights"].items()})
        x = data["x"].clone().requires_grad_(True)
        out, bias = layer(x, None)
        assert bias is None
        (out * data["g"]).sum().backward()
        ref = torch.load(tmp_path / f"{name}_out.pt")
        torch.testing.assert_close(out, ref["out"], rtol=1e-5, atol=1e-5, msg=f"{name}: output")
        torch.testing.assert_close(x.grad, ref["dx"], rtol=1e-5, atol=1e-5, msg=f"{name}: input grad")
        ours = {k: p.grad for k, p in layer.named_parameters()}
        assert sorted(OURS.get(k, k) for k in ref["grads"]) == sorted(ours)
        for core_name, grad in ref["grads"].items():
            torch.testing.assert_close(ours[OURS.get(core_name, core_name)], grad, rtol=1e-5, atol=1e-5,
                                       msg=f"{name}: grad of {core_name}")
