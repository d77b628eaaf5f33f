"""Multi-latent attention in GPTModel (megatron/models/deepseek/mla.py): the family spec is chosen from the config,
Megatron Core's parameter names, the latent KV cache (small, and equal to the no-cache forward: logits and greedy
generation), selective recompute, and the one-line refusals. Megatron Core parity: test_mla_mcore_oracle.py."""
from __future__ import annotations

import pytest
import torch

from megatron.arguments import parse_args, validate_args
from megatron.flops import num_floating_point_operations
from megatron.layers import InferenceParams
from megatron.layers.mcore_names import core_to_ours, ours_to_core
from megatron.models.deepseek.mla import MLASelfAttention
from megatron.text_generation.generation import generate_tokens
from megatron.theoretical_memory_usage import count_parameters, model_config
from tests.model.helpers import VOCAB, batch, build_gpt, tiny_config

MLA = dict(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope",
           add_bias_linear=False, swiglu=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6, max_position_embeddings=32)
ATTENTION_KEYS = ["linear_q_down_proj.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
                  "linear_kv_up_proj.weight", "q_layernorm.weight", "kv_layernorm.weight", "linear_proj.weight"]


def test_the_config_selects_mla_with_core_names():
    model = build_gpt(tiny_config(**MLA))
    attention = model.language_model.encoder.layers[0].self_attention
    assert isinstance(attention, MLASelfAttention)
    prefix = "language_model.encoder.layers.0.self_attention."
    assert [k[len(prefix):] for k in model.state_dict() if k.startswith(prefix)] == ATTENTION_KEYS
    shapes = {k: tuple(v.shape) for k, v in attention.state_dict().items()}
    assert shapes["linear_q_up_proj.weight"] == (4 * (8 + 4), 24)
    assert shapes["linear_kv_down_proj.weight"] == (16 + 4, 32)
    assert shapes["linear_kv_up_proj.weight"] == (4 * (8 + 6), 16)
    assert shapes["linear_proj.weight"] == (32, 4 * 6)
    plain = build_gpt(tiny_config(**dict(MLA, q_lora_rank=None)))
    names = list(plain.language_model.encoder.layers[0].self_attention.state_dict())
    assert names[:2] == ["linear_q_proj.weight", "linear_kv_down_proj.weight"] and "q_layernorm.weight" not in names


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_latent_kv_cache_matches_the_full_forward(q_lora_rank):
    model = build_gpt(tiny_config(**dict(MLA, q_lora_rank=q_lora_rank))).eval()
    ids, pos, mask, _ = batch()
    with torch.no_grad():
        full = model(ids, pos, mask)
        params = InferenceParams(max_batch_size=2, max_sequence_length=8)
        outs = [model(ids[:, :5], pos[:, :5], mask[..., :5, :5], inference_params=params)]
        params.sequence_len_offset = 5
        for t in range(5, 8):  # absorbed decode steps; the full mask is sliced by the attention
            outs.append(model(ids[:, t: t + 1], pos[:, t: t + 1], mask, inference_params=params))
            params.sequence_len_offset += 1
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-5, atol=1e-5)
    latents, rope_keys = params.key_value_memory_dict[1]
    assert tuple(latents.shape) == (8, 2, 16) and tuple(rope_keys.shape) == (8, 2, 4)  # per token: 16 + 4 numbers


def test_greedy_generation_with_the_latent_cache_equals_without():
    model = build_gpt(tiny_config(**MLA), seed=3).eval()
    prompts = [[5, 9, 11, 3], [7, 2]]
    cached = generate_tokens(model, prompts, 12, eod_id=VOCAB - 1, greedy=True, use_kv_cache=True)
    plain = generate_tokens(model, prompts, 12, eod_id=VOCAB - 1, greedy=True, use_kv_cache=False)
    assert torch.equal(cached.tokens, plain.tokens)
    assert cached.tokens.size(1) == 16


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="selective"),
                                       dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1)])
def test_recompute_gives_the_same_loss_and_grads(recompute):
    ids, pos, mask, labels = batch()
    results = []
    for extra in ({}, recompute):
        model = build_gpt(tiny_config(**MLA, **extra))
        loss = model(ids, pos, mask, labels=labels).mean()
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("overrides, message", [
    (dict(group_query_attention=True, num_query_groups=2), "exclude each other"),
    (dict(qk_pos_emb_head_dim=3), "even rotary dimension"),
    (dict(rope_type="rope", use_rope_scaling=True), "do not apply to --multi-latent-attention"),
    (dict(position_embedding_type="alibi"), "not alibi"),
    (dict(kv_lora_rank=0), "--kv-lora-rank must be >= 1"),
    (dict(use_flash_attn=True), "drop --use-flash-attn"),
])
def test_impossible_mla_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**dict(MLA, **overrides))


def test_context_parallelism_is_refused_in_one_line():
    attention = MLASelfAttention(tiny_config(**MLA), 1)
    with pytest.raises(ValueError, match="--context-parallel-size 1"):
        attention.set_context_parallel(object())


def test_core_names_round_trip_and_read_transformer_engine_spellings():
    model = build_gpt(tiny_config(**MLA))
    ours = {k: v for k, v in model.state_dict().items() if ".layers.0." in k}
    core = ours_to_core(ours)
    prefix = "decoder.layers.0.self_attention."
    assert prefix + "linear_proj.weight" in core and prefix + "linear_kv_down_proj.weight" in core
    assert prefix + "q_layernorm.weight" in core and prefix + "kv_layernorm.weight" in core
    assert core_to_ours(core).keys() == ours.keys()
    te = {k.replace("q_layernorm.weight", "linear_q_up_proj.layer_norm_weight")
          .replace("kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight"): v for k, v in core.items()}
    back = core_to_ours(te)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


def _mla_args(*extra: str):
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "32", "--micro-batch-size", "1", "--vocab-size", "64", "--tokenizer-type",
             "NullTokenizer", "--make-vocab-size-divisible-by", "1", "--multi-latent-attention", "--qk-layernorm",
             "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
             "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
             *extra]
    args = parse_args(args=flags)
    args.world_size = 1
    args = validate_args(args)
    args.padded_vocab_size = 64
    return args


@pytest.mark.parametrize("extra", [("--q-lora-rank", "24"), ()])
def test_parameter_report_and_flops_count_the_mla_model(extra):
    args = _mla_args(*extra)
    config = model_config(args)
    model = build_gpt(config)
    assert count_parameters(args).total == sum(p.numel() for p in model.parameters())
    h, n, s, layers = 32, 4, 16, 2
    q = (24 * (h + n * 12 + 1)) if extra else h * n * 12
    attention = q + 16 * (h + n * (8 + 6) + 1) + h * 4 + n * 6 * h + s * n * 12 + s * n * 6
    mlp = 2 * h * config.ffn_hidden_size * 1.5
    expected = 6 * 3 * s * layers * (attention + mlp) + 6 * 3 * s * h * 64
    assert num_floating_point_operations(config, 3, s) == pytest.approx(expected, rel=1e-12)
