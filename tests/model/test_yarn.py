"""YaRN rotary embedding (--rope-type yarn) against Hugging Face's rope_type "yarn" and megatron-core 0.16.1.

Proof: the frequencies and the concentration (attention_factor) equal HF's `ROPE_INIT_FUNCTIONS["yarn"]` bitwise over
configs that exercise every branch (rounded and unrounded correction range, mscale/mscale_all_dim, beta values), the
cos/sin tables equal HF's rotary module's output bitwise; megatron-core's YarnRotaryEmbedding gives the same tables
(subprocess oracle); a HF Llama / Qwen2 with rope_scaling yarn gives the same logits (1e-5) and 32-token greedy KV-cache
generation as our twin, which differs from the unscaled model; the config maps back to the same HF rope parameters;
the flags reach the config and checkpoints; impossible or ignored values are one-line errors.
"""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from megatron.arguments import ArgumentError, core_transformer_config_from_args, parse_args, validate_args
from megatron.layers.rotary import (
    RotaryEmbedding,
    YarnScaling,
    rotary_cos_sin,
    yarn_concentration,
    yarn_softmax_scale,
)
from megatron.models.gpt.hf_llama import hf_llama_config_kwargs, yarn_fields_from_hf
from megatron.text_generation import generate
from tests.mcore_oracle import ORACLE_CPU_PRELUDE, run_oracle
from tests.model.hf_llama_helpers import VOCAB, causal_inputs, hf_model, megatron_twin

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")

# HF rope parameters -> the YarnScaling they mean (HF reads mscale/mscale_all_dim only when both are set)
CASES = {
    "rounded": ({"factor": 4.0, "original_max_position_embeddings": 32}, YarnScaling(4.0, 32)),
    "gpt_oss_unrounded": ({"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                           "beta_slow": 1.0, "truncate": False}, YarnScaling(32.0, 4096, round_to_int=False)),
    "deepseek_mscale": ({"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                         "mscale_all_dim": 1.0}, YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0)),
    "both_mscales_betas": ({"factor": 8.0, "original_max_position_embeddings": 2048, "mscale": 0.707,
                            "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0},
                           YarnScaling(8.0, 2048, 16.0, 2.0, 0.707, 0.5)),
    "mscale_alone_ignored": ({"factor": 2.5, "original_max_position_embeddings": 1024, "mscale": 0.9},
                             YarnScaling(2.5, 1024)),
}


def _hf_config(rope: dict, head_dim: int = 64, theta: float = 10000.0):
    return transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=131072,
                                    rope_theta=theta, rope_scaling={"rope_type": "yarn", **rope})


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_concentration_and_tables_equal_hf_bitwise(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope, scaling = CASES[case]
    assert yarn_fields_from_hf({"rope_type": "yarn", **rope}, 131072)["mscale"] == scaling.mscale
    for head_dim, theta in ((64, 10000.0), (128, 150000.0)):
        hf_config = _hf_config(rope, head_dim, theta)
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
        ours = RotaryEmbedding(head_dim, theta, yarn=scaling)
        assert torch.equal(ours.inv_freq(CPU), inv_freq)
        assert ours.concentration == attention_factor
        positions = torch.arange(300).unsqueeze(0)
        cos, sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
        our_cos, our_sin = ours.cos_sin(300, 0, CPU, torch.float32)
        assert torch.equal(our_cos[:, 0, 0], cos[0]) and torch.equal(our_sin[:, 0, 0], sin[0])
        late_cos, _ = ours.cos_sin(7, 290, CPU, torch.float32)  # a decode offset reads the same rows
        assert torch.equal(late_cos[:, 0, 0], cos[0, 290:297])
    # the blend is not vacuous: some frequencies kept, some divided by the factor
    ratio = RotaryEmbedding(64, 10000.0, yarn=scaling).inv_freq(CPU) / RotaryEmbedding(64, 10000.0).inv_freq(CPU)
    assert ratio[0] == 1 and torch.isclose(ratio[-1], torch.tensor(1 / scaling.factor))


def test_mla_helpers_give_cos_sin_mscale_and_megatrons_softmax_scale():
    class Cfg:  # what a TransformerConfig with multi-latent attention carries (rope_type unset: yarn by default)
        multi_latent_attention, rope_type, rotary_base, rotary_percent, kv_channels = True, None, 10000.0, 1.0, 32
        rotary_dim, use_rope_scaling, rotary_seq_len_interpolation_factor = 32, False, None
        rotary_scaling_factor, mscale, mscale_all_dim, original_max_position_embeddings = 40.0, 0.707, 0.707, 4096
        beta_fast, beta_slow, yarn_correction_range_round_to_int = 32.0, 1.0, True

    cos, sin, concentration = rotary_cos_sin(Cfg, 16, 5, 3, CPU, torch.float32)
    scaling = YarnScaling(40.0, 4096, 32.0, 1.0, 0.707, 0.707)
    ref_cos, ref_sin = RotaryEmbedding(16, 10000.0, yarn=scaling).cos_sin(5, 3, CPU, torch.float32)
    assert cos.shape == (5, 1, 1, 16) and torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert concentration == yarn_concentration(scaling) == 1.0
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert yarn_softmax_scale(Cfg, 24) == pytest.approx(mscale * mscale / 24 ** 0.5, rel=1e-15)


ORACLE = ORACLE_CPU_PRELUDE + '''
import sys, torch
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
out = {}
for name, (dim, base, kw) in CASES.items():
    emb = YarnRotaryEmbedding(dim, rotary_base=base, use_cpu_initialization=True, **kw)
    cos, sin = emb.get_cached_cos_sin(300, dtype=torch.float32)
    out[name] = (cos.clone(), sin.clone())
torch.save(out, sys.argv[1] if len(sys.argv) > 1 else "tables.pt")
'''


def test_tables_equal_megatron_core_yarn_rotary_embedding(tmp_path):
    cases = {name: (64, 10000.0, dict(scaling_factor=s.factor, original_max_position_embeddings=s.
                                      original_max_position_embeddings, beta_fast=s.beta_fast, beta_slow=s.beta_slow,
                                      mscale=s.mscale, mscale_all_dim=s.mscale_all_dim,
                                      correction_range_round_to_int=s.round_to_int))
             for name, (_, s) in CASES.items()}
    run_oracle(f"CASES = {cases!r}\n" + ORACLE, tmp_path)
    tables = torch.load(tmp_path / "tables.pt")
    for name, (_, scaling) in CASES.items():
        cos, sin = RotaryEmbedding(64, 10000.0, yarn=scaling).cos_sin(300, 0, CPU, torch.float32)
        torch.testing.assert_close(cos, tables[name][0], rtol=0, atol=2e-6)  # its outer product vs HF's matmul
        torch.testing.assert_close(sin, tables[name][1], rtol=0, atol=2e-6)


YARN_HF = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
           "beta_slow": 1.0}
PROMPTS = [[5, 17, 33], [9, 2, 60, 40, 3, 58, 12]]


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2_qkv_bias"])
def test_logits_and_greedy_generation_equal_hf(family):
    hf = hf_model(family, seed=1, rope_scaling=dict(YARN_HF, rope_theta=FAMILY_THETA[family]))
    model = megatron_twin(hf)
    assert model.config.rope_type == "yarn" and model.config.rotary_scaling_factor == 4.0
    ids, pos, mask = causal_inputs(seq=40)
    with torch.no_grad():
        ours, theirs = model(ids, pos, mask), hf(input_ids=ids).logits
        unscaled = megatron_twin(hf_model(family, seed=1))(ids, pos, mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (unscaled - theirs).abs().max() > 0.1  # YaRN changes the model: the comparison is not vacuous
    out = generate(model, None, PROMPTS, 32, greedy=True, eod_id=VOCAB - 1, use_eod_token_for_early_termination=False)
    for prompt, row in zip(PROMPTS, out["tokens"]):  # 32 KV-cache decode steps read the YaRN table at their offsets
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert row == ref[0].tolist()
    back = getattr(transformers, type(hf.config).__name__)(**hf_llama_config_kwargs(model.config),
                                                           attn_implementation="eager")
    hf_back = type(hf)(back).float().eval()
    hf_back.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert torch.equal(hf_back(input_ids=ids).logits, theirs)  # the exported rope parameters mean the same


FAMILY_THETA = {"llama_gqa": 123456.0, "qwen2_qkv_bias": 1e6}


def test_attention_factor_other_than_yarns_is_refused_naming_it():
    with pytest.raises(ValueError, match="attention_factor") as info:
        yarn_fields_from_hf({**YARN_HF, "attention_factor": 1.5}, 64)
    assert "\n" not in str(info.value)
    fields = yarn_fields_from_hf({**YARN_HF, "attention_factor": 0.1 * math.log(4.0) + 1}, 64)
    assert fields["rotary_scaling_factor"] == 4.0


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100", "--position-embedding-type", "rope"]
YARN = ["--rope-type", "yarn", "--rotary-scaling-factor", "8", "--mscale", "0.7", "--mscale-all-dim", "0.5",
        "--yarn-original-max-position-embeddings", "2048", "--yarn-beta-fast", "16", "--yarn-beta-slow", "2",
        "--no-yarn-correction-range-round-to-int"]


def _validated(*flags: str) -> argparse.Namespace:
    args = parse_args(args=[*BASE, *flags])
    args.rank = 1  # quiet argument dump
    return validate_args(args, {})


def test_flags_reach_the_config_and_use_checkpoint_args_restores_them(tmp_path):
    from megatron import compat as ck

    args = _validated(*YARN, "--save", str(tmp_path), "--save-interval", "1")
    expected = YarnScaling(8.0, 2048, 16.0, 2.0, 0.7, 0.5, False)
    assert RotaryEmbedding.from_config(core_transformer_config_from_args(args)).yarn == expected
    args.padded_vocab_size = 128
    ck.save_checkpoint(3, [torch.nn.Linear(2, 2)], None, None, args)
    restored = parse_args(args=["--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                                "--load", str(tmp_path), "--use-checkpoint-args"])
    ck.load_args_from_checkpoint(restored)
    restored.rank = 1
    validate_args(restored, {})
    assert RotaryEmbedding.from_config(core_transformer_config_from_args(restored)).yarn == expected
    plain = core_transformer_config_from_args(_validated())
    assert plain.rope_type is None and RotaryEmbedding.from_config(plain).yarn is None


@pytest.mark.parametrize("flags, named", [
    (["--rotary-scaling-factor", "4"], "--rotary-scaling-factor needs --rope-type yarn"),
    (["--yarn-beta-fast", "8"], "--yarn-beta-fast needs --rope-type yarn"),
    (["--no-yarn-correction-range-round-to-int"], "--no-yarn-correction-range-round-to-int needs"),
    (["--rope-type", "rope", "--mscale", "0.5"], "--mscale needs --rope-type yarn"),
    (["--rope-type", "yarn", "--yarn-beta-slow", "0"], "--yarn-beta-slow must be positive"),
    (["--rope-type", "yarn", "--use-rope-scaling"], "does not combine"),
    (["--position-embedding-type", "learned_absolute", "--rope-type", "yarn"], "--position-embedding-type rope"),
])
def test_impossible_or_ignored_yarn_values_are_one_line_errors(flags, named):
    with pytest.raises(ArgumentError) as info:
        _validated(*flags)
    assert named in str(info.value) and "\n" not in str(info.value)
