"""Qwen3 (--qk-layernorm, --kv-channels != hidden/heads) and sliding-window attention (--window-size,
--window-attn-skip-freq) against Hugging Face (fp32, tiny offline configs): logits, greedy KV-cache generation past
the window, the weight round trip; the window mask's paths (SDPA, explicit, context-parallel rows) agree."""
from __future__ import annotations

import pytest
import torch

from megatron.core import context_parallel
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.attention import window_mask
from megatron.models.gpt.hf_llama import (
    hf_llama_architecture,
    hf_window_kwargs,
    megatron_to_hf_llama_state_dict,
    window_fields_from_hf,
)
from megatron.settings.model import window_size_type
from megatron.text_generation import generate
from tests.model.hf_llama_helpers import VOCAB, causal_inputs, hf_model, megatron_twin

transformers = pytest.importorskip("transformers")

FAMILIES = ["qwen3_head_dim", "mistral_window8", "qwen3_window_layers"]


def _hf_greedy(hf, prompt, new):
    return hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                       pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_hf_past_the_window(family):
    hf = hf_model(family)
    model = megatron_twin(hf)
    ids, pos, mask = causal_inputs(seq=20)  # longer than every window
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        with_mask, without = model(ids, pos, mask), model(ids, pos, None)
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(with_mask, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(without, theirs, rtol=1e-5, atol=1e-5)


def test_mapped_fields():
    q3, mistral, layers = (megatron_twin(hf_model(f)).config for f in FAMILIES)
    assert (q3.qk_layernorm, q3.kv_channels, q3.add_qkv_bias, q3.window_size) == (True, 12, False, None)
    assert (mistral.window_size, mistral.window_attn_skip_freq) == ((7, 0), None)
    assert (layers.window_size, layers.window_attn_skip_freq) == ((4, 0), [0, 1])  # max_window_layers 1 of 2
    assert [layers.is_window_layer(i) for i in (1, 2)] == [False, True]


def test_window_changes_the_logits_only_past_the_window():
    hf = hf_model("mistral_window8")
    windowed, glob = megatron_twin(hf), megatron_twin(hf, window_size=None)
    ids, pos, mask = causal_inputs(seq=20)
    with torch.no_grad():
        a, b = windowed(ids, pos, mask), glob(ids, pos, mask)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=0)  # positions 0..7 see no more than 8 keys
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


@pytest.mark.parametrize("family,prompt_len,new", [("qwen3_head_dim", 5, 32), ("mistral_window8", 3, 48),
                                                   ("qwen3_window_layers", 4, 32)])
def test_greedy_kv_cache_equals_hf_generate(family, prompt_len, new):
    hf = hf_model(family, seed=1)
    model = megatron_twin(hf)
    prompts = [[5, 17, 33, 2, 9, 41][:prompt_len], [9, 2, 60, 40, 3, 58, 12][:prompt_len + 1]]
    out = generate(model, None, prompts, new, greedy=True, eod_id=VOCAB - 1,
                   use_eod_token_for_early_termination=False)
    for prompt, row in zip(prompts, out["tokens"]):
        assert row[:len(prompt) + new] == _hf_greedy(hf, prompt, new)


def test_kv_cache_equals_recompute_past_the_window():
    model = megatron_twin(hf_model("mistral_window8", seed=2))
    kw = dict(eod_id=VOCAB - 1, random_seed=5, top_k=5, return_output_log_probs=True,
              use_eod_token_for_early_termination=False)
    prompts = [[5, 17, 33], [9, 2, 60, 40, 3]]
    cached = generate(model, None, prompts, 20, use_kv_cache=True, **kw)
    recomputed = generate(model, None, prompts, 20, use_kv_cache=False, **kw)
    assert cached["tokens"] == recomputed["tokens"]
    for a, b in zip(cached["logprobs"], recomputed["logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_round_trip_to_hf(family):
    hf = hf_model(family)
    model = megatron_twin(hf)
    back = megatron_to_hf_llama_state_dict(model.state_dict_for_save_checkpoint(), model.config)
    ref = hf.state_dict()
    assert set(back) == {k for k in ref if "rotary" not in k}
    for k, v in back.items():
        assert torch.equal(v, ref[k]), k
    name = hf_llama_architecture(model.config)
    assert name == type(hf).__name__
    rebuilt = getattr(transformers, name.replace("ForCausalLM", "Config"))(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **hf_window_kwargs(model.config, name))
    assert window_fields_from_hf(rebuilt) == {k: getattr(model.config, k) for k in window_fields_from_hf(hf.config)}


def test_explicit_path_equals_sdpa_with_window():
    model = megatron_twin(hf_model("qwen3_window_layers"))
    ids, pos, mask = causal_inputs(seq=16)
    with torch.no_grad():
        sdpa = model(ids, pos, mask)
        for layer in model.language_model.encoder.layers:
            layer.self_attention.core_attention.allow_sdpa = False
        explicit = model(ids, pos, mask)
    torch.testing.assert_close(explicit, sdpa, rtol=1e-5, atol=1e-5)


def test_window_mask_rows_match_context_parallel_rows():
    full = window_mask(None, 16, 16, (3, 0), torch.device("cpu"))
    expected = torch.tensor([[k > q or k < q - 3 for k in range(16)] for q in range(16)])
    assert torch.equal(full, expected)
    decode = window_mask(None, 1, 12, (3, 0), torch.device("cpu"))  # the last query against a 12-key cache
    assert torch.equal(decode, expected[11:12, :12])
    for rank in range(2):  # the rows ParallelAttention builds from a CP rank's true positions
        rows = context_parallel.cp_positions(16, 2, rank)
        assert torch.equal(full[rows], full.index_select(0, rows))


def test_window_flags_and_refusals():
    assert window_size_type("4095,0") == (4095, 0) and window_size_type("(7, 0)") == (7, 0) == window_size_type("[7,0]")
    with pytest.raises(ValueError, match="pass --window-size 4,0"):
        TransformerConfig(num_layers=2, window_size=(4, 2))
    with pytest.raises(ValueError, match="lists 3 layers but --num-layers is 2"):
        TransformerConfig(num_layers=2, window_size=(4, 0), window_attn_skip_freq=[1, 0, 1])
    with pytest.raises(ValueError, match="--multi-latent-attention has no sliding window here"):
        TransformerConfig(num_layers=2, window_size=(4, 0), multi_latent_attention=True, qk_layernorm=True,
                          normalization="RMSNorm", position_embedding_type="rope")
    cfg = TransformerConfig(num_layers=4, window_size=(4, 0), window_attn_skip_freq=2)
    assert [cfg.is_window_layer(i) for i in range(1, 5)] == [True, False, True, False]  # Megatron Core's rule


def test_window_config_both_ways_for_each_architecture():
    """Each HF architecture's sliding-window fields read back to the same --window-size / --window-attn-skip-freq
    (Mixtral, Qwen3-MoE: every layer; Qwen2/Qwen3/Qwen2-MoE: layer_types); a per-layer pattern has no Mixtral form."""
    every = TransformerConfig(num_layers=4, window_size=(7, 0))
    some = TransformerConfig(num_layers=4, window_size=(7, 0), window_attn_skip_freq=2)
    cases = [(every, "MistralConfig"), (every, "MixtralConfig"), (every, "Qwen3MoeConfig"), (some, "Qwen2Config"),
             (some, "Qwen3Config"), (some, "Qwen2MoeConfig")]
    for config, cls in cases:
        name = cls.replace("Config", "ForCausalLM")
        hf = getattr(transformers, cls)(num_hidden_layers=4, **hf_window_kwargs(config, name))
        assert window_fields_from_hf(hf) == {"window_size": (7, 0),
                                             "window_attn_skip_freq": None if config is every else [1, 0, 1, 0]}, cls
    with pytest.raises(ValueError, match="MixtralForCausalLM slides its window on every layer"):
        hf_window_kwargs(some, "MixtralForCausalLM")
    assert hf_window_kwargs(TransformerConfig(num_layers=2), "MistralForCausalLM") == {"sliding_window": None}


def test_checkpoint_architecture_records_and_restores_the_window():
    """The architecture record holds --qk-layernorm / --window-size / --window-attn-skip-freq; --use-checkpoint-args
    restores them, a run without them is refused naming the flag."""
    import argparse

    from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.checkpoint.args import (
        ArchitectureMismatchError,
        architecture_changes,
        architecture_from_args,
        compare_architecture,
        flag_defaults,
    )

    def validated(extra: str) -> argparse.Namespace:
        args = parse_args(args=("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                                "--max-position-embeddings 64 --micro-batch-size 2 " + extra).split())
        args.world_size = 1
        return validate_args(args)

    saved = architecture_from_args(validated("--qk-layernorm --window-size 7,0 --window-attn-skip-freq [1,0]"))
    assert (saved["qk_layernorm"], saved["window_size"], saved["window_attn_skip_freq"]) == (True, [7, 0], [1, 0])
    with pytest.raises(ArchitectureMismatchError, match="window_size=\\[7, 0\\].*pass --window-size \\[7,0\\] to match"):
        compare_architecture(saved, {**architecture_from_args(validated("--qk-layernorm")),
                                     "window_attn_skip_freq": [1, 0]}, "ckpt")
    plain = validated("")
    changes = architecture_changes(vars(plain), saved, None, flag_defaults())
    restored = argparse.Namespace(**{**vars(plain), **changes})
    config = core_transformer_config_from_args(restored)
    assert (config.qk_layernorm, config.window_size, config.window_attn_skip_freq) == (True, (7, 0), [1, 0])
