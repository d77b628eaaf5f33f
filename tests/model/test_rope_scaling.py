"""RoPE scaling (Llama-3.1 --use-rope-scaling, linear --rotary-seq-len-interpolation-factor) against Hugging Face.

Proof: the scaled frequencies equal HF's rope_type "llama3" bitwise (Llama-3.1's own settings) and cover all three
bands in the tiny test config; a HF LlamaForCausalLM with rope_scaling llama3 / linear gives the same logits (1e-5)
and the same greedy KV-cache generation as our twin, which differs from the unscaled model (the scaling is applied);
the flags reach the config, checkpoints record them and --use-checkpoint-args restores them; impossible values are
one-line errors.
"""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron.arguments import ArgumentError, core_transformer_config_from_args, parse_args, validate_args
from megatron.layers.rotary import Llama3Scaling, RotaryEmbedding
from megatron.models.gpt.hf_llama import hf_llama_config_kwargs
from megatron.text_generation import generate
from tests.model.hf_llama_helpers import VOCAB, causal_inputs, hf_model, megatron_twin

transformers = pytest.importorskip("transformers")

# head_dim 8, theta 5000: wavelengths 6.3, 53, 444, 3736 -> one kept (< 32/4), one blended, two stretched (> 32/0.5)
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 0.5, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
LINEAR = {"rope_type": "linear", "factor": 3.0}
PROMPTS = [[5, 17, 33], [9, 2, 60, 40, 3, 58, 12]]


def test_llama3_frequencies_equal_hf_bitwise_and_cover_every_band():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf31 = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                                    rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                       "original_max_position_embeddings": 8192})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf31, "cpu")
    ours = RotaryEmbedding(128, 500000.0, llama3_scaling=Llama3Scaling()).inv_freq(torch.device("cpu"))
    assert torch.equal(ours, theirs)  # Llama3Scaling's defaults are Llama-3.1's (Megatron-LM's hard-coded values)
    cpu = torch.device("cpu")
    ratio = (RotaryEmbedding(8, 5000.0, llama3_scaling=Llama3Scaling(4.0, 0.5, 4.0, 32)).inv_freq(cpu)
             / RotaryEmbedding(8, 5000.0).inv_freq(cpu))
    assert ratio[0] == 1 and 0.25 < ratio[1] < 1 and torch.allclose(ratio[2:], torch.tensor(0.25))


@pytest.mark.parametrize("rope_scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_logits_and_greedy_generation_equal_hf(rope_scaling):
    hf = hf_model("llama_gqa", seed=1, rope_scaling=rope_scaling)
    model = megatron_twin(hf)
    ids, pos, mask = causal_inputs(seq=40)
    with torch.no_grad():
        ours, theirs = model(ids, pos, mask), hf(input_ids=ids).logits
        unscaled = megatron_twin(hf_model("llama_gqa", seed=1))(ids, pos, mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (unscaled - theirs).abs().max() > 0.1  # the scaling changes the model: the comparison is not vacuous
    out = generate(model, None, PROMPTS, 10, greedy=True, eod_id=VOCAB - 1, use_eod_token_for_early_termination=False)
    for prompt, row in zip(PROMPTS, out["tokens"]):  # the KV-cache decode steps use the scaled table too
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert row == ref[0].tolist()
    # and the config maps back to the same HF rope parameters
    back = transformers.LlamaConfig(**hf_llama_config_kwargs(model.config)).rope_parameters
    assert back == hf.config.rope_parameters


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100", "--position-embedding-type", "rope"]
SCALED = ["--use-rope-scaling", "--rope-scaling-factor", "16", "--rope-scaling-low-freq-factor", "2",
          "--rope-scaling-high-freq-factor", "6", "--rope-scaling-original-max-position-embeddings", "4096",
          "--rotary-seq-len-interpolation-factor", "2"]


def _validated(*flags: str) -> argparse.Namespace:
    args = parse_args(args=[*BASE, *flags])
    args.rank = 1  # quiet argument dump
    return validate_args(args, {})


def test_flags_reach_the_config_and_use_checkpoint_args_restores_them(tmp_path):
    from megatron import compat as ck
    from megatron.checkpoint.args import ArchitectureMismatchError

    args = _validated(*SCALED, "--save", str(tmp_path), "--save-interval", "1")
    c = core_transformer_config_from_args(args)
    assert (c.use_rope_scaling, c.rope_scaling_factor, c.rope_scaling_low_freq_factor, c.rope_scaling_high_freq_factor,
            c.rope_scaling_original_max_position_embeddings, c.rotary_seq_len_interpolation_factor) == (
        True, 16.0, 2.0, 6.0, 4096, 2.0)
    rotary = RotaryEmbedding.from_config(c)
    assert rotary.llama3_scaling == (16.0, 2.0, 6.0, 4096) and rotary.seq_len_interpolation_factor == 2.0
    args.padded_vocab_size = 128
    ck.save_checkpoint(3, [torch.nn.Linear(2, 2)], None, None, args)
    restored = parse_args(args=["--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                                "--load", str(tmp_path), "--use-checkpoint-args"])
    ck.load_args_from_checkpoint(restored)
    restored.rank = 1
    validate_args(restored, {})
    r = core_transformer_config_from_args(restored)
    assert (r.use_rope_scaling, r.rope_scaling_factor, r.rope_scaling_low_freq_factor, r.rope_scaling_high_freq_factor,
            r.rope_scaling_original_max_position_embeddings, r.rotary_seq_len_interpolation_factor) == (
        True, 16.0, 2.0, 6.0, 4096, 2.0)
    # loading with different scaling is the loader's one-line mismatch
    other = _validated(*SCALED[:-4], "--rotary-seq-len-interpolation-factor", "2", "--load", str(tmp_path))
    with pytest.raises(ArchitectureMismatchError, match="has rope_scaling_original_max_position_embeddings=4096"):
        ck.load_checkpoint([torch.nn.Linear(2, 2)], None, None, other)


@pytest.mark.parametrize("flags, named", [
    (["--rope-scaling-factor", "4"], "--use-rope-scaling"),
    (["--rope-scaling-original-max-position-embeddings", "2048"], "--use-rope-scaling"),
    (["--use-rope-scaling", "--rope-scaling-high-freq-factor", "1"], "--rope-scaling-high-freq-factor"),
    (["--use-rope-scaling", "--rope-scaling-factor", "0"], "--rope-scaling-factor"),
    (["--rotary-seq-len-interpolation-factor", "-1"], "--rotary-seq-len-interpolation-factor"),
    (["--position-embedding-type", "learned_absolute", "--use-rope-scaling"], "--position-embedding-type rope"),
])
def test_impossible_rope_scaling_is_a_one_line_error(flags, named):
    with pytest.raises(ArgumentError) as info:
        _validated(*flags)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_hf_export_refuses_both_scalings_at_once():
    c = core_transformer_config_from_args(_validated("--use-rope-scaling", "--rotary-seq-len-interpolation-factor",
                                                     "2", "--swiglu", "--normalization", "RMSNorm",
                                                     "--disable-bias-linear"))
    with pytest.raises(ValueError, match="one rope_type"):
        hf_llama_config_kwargs(c)


@pytest.mark.parametrize("rope_scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_conversion_keeps_the_scaling_both_ways(tmp_path, rope_scaling):
    """HF -> Megatron (tools/checkpoint/convert.py) records the scaling and prints its flags; Megatron -> HF writes the
    same rope_parameters and the converted HF model gives the original's logits."""
    import shlex

    from megatron.arguments import build_parser
    from megatron.checkpoint.conversion.driver import convert
    from megatron.checkpoint.conversion.driver import parse_args as convert_args
    from megatron.compat import check_architecture, load_state_dict_file

    hf = hf_model("llama_gqa", seed=2, rope_scaling=rope_scaling)
    hf.save_pretrained(tmp_path / "hf")

    def run(src, dst, *extra):
        return convert(convert_args(["--model-type", "GPT", "--load-dir", str(src), "--save-dir", str(dst), *extra]))

    out = run(tmp_path / "hf", tmp_path / "meg", "--loader", "hf")
    saved = load_state_dict_file(str(tmp_path / "meg" / "release" / "mp_rank_00" / "model_optim_rng.pt"))[
        "architecture"]
    args = build_parser().parse_args(shlex.split(out["flags"]) + ["--micro-batch-size", "1", "--tokenizer-type",
                                                                  "NullTokenizer", "--vocab-size", str(VOCAB)])
    args.rank, args.world_size = 1, 1
    check_architecture(saved, validate_args(args, {}), str(tmp_path / "meg"))  # the printed flags rebuild it
    assert ("--use-rope-scaling" in out["flags"]) == (rope_scaling is LLAMA3)
    run(tmp_path / "meg", tmp_path / "hf2", "--saver", "hf")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert hf2.config.rope_parameters == hf.config.rope_parameters
    ids = causal_inputs(seq=40)[0]
    with torch.no_grad():
        torch.testing.assert_close(hf2(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=0, atol=0)
