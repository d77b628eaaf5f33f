"""HF DeepseekV3 <-> Megatron mapping (megatron/models/deepseek/hf_deepseek_v3.py) without building our model: a tiny
DeepseekV3ForCausalLM's safetensors (Hub layout, with an MTP layer added as HF stores it) map to Megatron Core's
names and back bitwise, with and without q-lora; the config maps both ways; what HF expresses and Megatron does not is
refused in one line."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.models.deepseek import hf_deepseek_v3 as ds

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
            n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
            rope_parameters=YARN, tie_word_embeddings=False)


def tiny_config(q_lora_rank=24, **changes):
    """A tiny DeepseekV3Config: first-k dense, routed + shared experts in 2 groups, YaRN."""
    return transformers.DeepseekV3Config(**{**TINY, "q_lora_rank": q_lora_rank, **changes})


def _hf_tensors(config, tmp_path, mtp: bool) -> dict:
    """The Hub-layout tensors of a random tiny model as save_pretrained writes them (+ one HF-style MTP layer)."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn_like(p))
    model.save_pretrained(tmp_path)
    tensors = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    for k in [k for k in tensors if k.endswith("e_score_correction_bias")]:  # a buffer: give it values too
        tensors[k] = torch.randn_like(tensors[k])
    if mtp:  # HF's MTP layer num_hidden_layers: a decoder layer (MoE here) + its own tensors
        n, h = config.num_hidden_layers, config.hidden_size
        last = f"model.layers.{n - 1}."
        tensors.update({f"model.layers.{n}." + k[len(last):]: torch.randn_like(v) for k, v in tensors.items()
                        if k.startswith(last)})
        mtp_prefix = f"model.layers.{n}."
        tensors.update({mtp_prefix + "enorm.weight": torch.randn(h), mtp_prefix + "hnorm.weight": torch.randn(h),
                        mtp_prefix + "eh_proj.weight": torch.randn(h, 2 * h),
                        mtp_prefix + "shared_head.norm.weight": torch.randn(h),
                        mtp_prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"],
                        mtp_prefix + "shared_head.head.weight": tensors["lm_head.weight"]})
    return tensors


def _config_view(fields: dict) -> SimpleNamespace:
    """The fields as a config object (what TransformerConfig gives the saver), with Megatron's defaults."""
    defaults = dict(moe_shared_expert_gate=False, moe_expert_capacity_factor=None, num_moe_experts=None,
                    moe_layer_freq=1, rope_type="rope", mtp_num_layers=None, yarn_correction_range_round_to_int=True)
    view = SimpleNamespace(**{**defaults, **fields})
    view.moe_layer_pattern = list(view.moe_layer_freq) if view.num_moe_experts else [0] * view.num_layers
    return view


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no_q_lora"])
def test_tensors_round_trip_bitwise(q_lora_rank, tmp_path):
    config = tiny_config(q_lora_rank)
    hf = _hf_tensors(config, tmp_path, mtp=True)
    n = config.num_hidden_layers
    fields = ds.deepseek_v3_fields_from_hf(config, ds.stored_mtp_layers(hf, n))
    assert fields["mtp_num_layers"] == 1 and fields["moe_layer_freq"] == [0, 1, 1]
    pattern = fields["moe_layer_freq"]
    ours = [ds.layer_from_hf(hf, f"model.layers.{i}.", bool(pattern[i])) for i in range(n)]
    assert (ds.Q_UP in ours[0]) == (q_lora_rank is not None) and (ds.Q_PROJ in ours[0]) == (q_lora_rank is None)
    assert ours[1][ds.W1].shape == (8, 32, 2 * 16) and ours[1][ds.W2].shape == (8, 16, 32)
    assert torch.equal(ours[1][ds.EXPERT_BIAS], hf["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert ds.FC1 in ours[0] and ds.ROUTER not in ours[0]
    mtp = ds.mtp_from_hf(hf, f"model.layers.{n}.", moe=True)
    assert ds.TRANSFORMER_LAYER + ds.W1 in mtp and ds.EH_PROJ in mtp
    back = {"model.embed_tokens.weight": hf["model.embed_tokens.weight"], "lm_head.weight": hf["lm_head.weight"],
            "model.norm.weight": hf["model.norm.weight"]}
    for i, layer in enumerate(ours):
        back.update(ds.layer_to_hf(layer, f"model.layers.{i}."))
    back.update(ds.mtp_to_hf(mtp, f"model.layers.{n}.", hf["model.embed_tokens.weight"], hf["lm_head.weight"]))
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no_q_lora"])
def test_config_round_trip(q_lora_rank):
    config = tiny_config(q_lora_rank)
    fields = ds.deepseek_v3_fields_from_hf(config, mtp_layers=1)
    assert fields["rope_type"] == "yarn" and fields["rotary_scaling_factor"] == 4.0
    assert fields["moe_router_num_groups"] == 2 and fields["moe_router_group_topk"] == 1
    assert fields["moe_shared_expert_intermediate_size"] == 16 and fields["moe_router_topk_scaling_factor"] == 2.5
    assert fields["qk_head_dim"] == 16 and fields["qk_pos_emb_head_dim"] == 8 and fields["q_lora_rank"] == q_lora_rank
    kwargs = ds.hf_deepseek_v3_config_kwargs(_config_view(fields))
    again = transformers.DeepseekV3Config(**kwargs)
    assert ds.deepseek_v3_fields_from_hf(again, mtp_layers=1) == fields
    assert again.rope_parameters == {**YARN, "rope_type": "yarn"} and again.num_nextn_predict_layers == 1


def test_config_without_moe_or_yarn():
    config = tiny_config(first_k_dense_replace=3, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    fields = ds.deepseek_v3_fields_from_hf(config)
    assert "num_moe_experts" not in fields and "mtp_num_layers" not in fields
    assert fields["rope_type"] == "rope" and fields["rotary_base"] == 500.0
    kwargs = ds.hf_deepseek_v3_config_kwargs(_config_view(fields))
    assert kwargs["first_k_dense_replace"] == 3 and kwargs["rope_parameters"]["rope_type"] == "default"


@pytest.mark.parametrize("change, words", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(n_group=4, topk_group=2, num_experts_per_tok=2), "topk_group"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
])
def test_refusals_name_the_field(change, words):
    with pytest.raises(ValueError, match=words) as err:
        ds.deepseek_v3_fields_from_hf(tiny_config(**change))
    assert "\n" not in str(err.value)


def test_saver_refuses_what_hf_cannot_route():
    fields = ds.deepseek_v3_fields_from_hf(tiny_config())
    with pytest.raises(ValueError, match="sigmoid"):
        ds.hf_deepseek_v3_config_kwargs(_config_view({**fields, "moe_router_score_function": "softmax"}))
    with pytest.raises(ValueError, match="dense layers first"):
        ds.hf_deepseek_v3_config_kwargs(_config_view({**fields, "moe_layer_freq": [1, 0, 1]}))
    for switch in ("multi_latent_attention", "qk_layernorm"):
        with pytest.raises(ValueError, match="--multi-latent-attention --qk-layernorm"):
            ds.hf_deepseek_v3_config_kwargs(_config_view({**fields, switch: False}))
