"""GPT-OSS parity with Hugging Face (fp32, tiny offline config; issue #38): the HF folder read by the conversion
loader gives a GPTModel whose logits (<= 1e-5) and 32-token greedy KV-cache generation equal GptOssForCausalLM's
(attention sinks, biases, clamped quick-GeGLU experts with interleaved gate/up, router bias, YaRN as published:
truncate False, and its sliding window of 8 on every other layer: generation goes 32 tokens past it); HF -> ours -> HF is
bitwise, also through Megatron checkpoints at TP2 x PP2 x EP2; the MXFP4-packed published layout is dequantised on
load as transformers does it."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.checkpoint.conversion.driver import convert as run_convert
from megatron.checkpoint.conversion.driver import parse_args as convert_args
from megatron.checkpoint.conversion.hf_format import read_hf, write_hf
from megatron.checkpoint.conversion.interchange import (
    ConversionError,
    messages_from_state_dict,
    state_dict_from_messages,
)
from megatron.models.gpt.hf_gpt_oss import dequantize_mxfp4
from megatron.text_generation import generate
from tests.model.helpers import twin_from_hf_folder

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

VOCAB, MAX_POS = 61, 64
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
              max_position_embeddings=MAX_POS, sliding_window=8, tie_word_embeddings=False, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
PROMPTS = [[5, 17, 33], [9, 2, 60, 40, 3, 58, 12]]


def _hf(folder, seed: int = 0):
    config = transformers.GptOssConfig(**CONFIG, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_((0.5 if "router" in name else 0.3) * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def _load(folder):
    return safetensors_torch.load_file(folder / "model.safetensors")


def test_logits_and_32_token_greedy_generation_equal_hf(tmp_path):
    hf = _hf(tmp_path / "hf")
    model, _ = twin_from_hf_folder(tmp_path / "hf")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 13), generator=g)
    pos = torch.arange(13).unsqueeze(0).expand(2, 13)
    with torch.no_grad():
        ours = model(ids, pos, torch.ones(1, 1, 13, 13, dtype=torch.bool).triu(1))
        theirs = hf(input_ids=ids).logits
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= 1e-5
    out = generate(model, None, PROMPTS, 32, greedy=True, eod_id=VOCAB - 1, use_eod_token_for_early_termination=False)
    for prompt, row in zip(PROMPTS, out["tokens"]):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert row == ref[0].tolist()


def test_hf_to_megatron_to_hf_is_bitwise_and_loads(tmp_path):
    hf = _hf(tmp_path / "hf", seed=4)
    meta, stream = read_hf(str(tmp_path / "hf"))
    assert (meta.architecture["softmax_type"], meta.architecture["activation_func_clamp_value"]) == ("learnable", 7.0)
    assert (meta.architecture["window_size"], meta.architecture["window_attn_skip_freq"]) == ([7, 0], [1, 0])
    flat = state_dict_from_messages(stream)
    summary = write_hf(meta, messages_from_state_dict(flat, 2), str(tmp_path / "out"))
    assert summary["architecture"] == "GptOssForCausalLM"
    before, after = _load(tmp_path / "hf"), _load(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    again = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").float()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(again.eval()(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_convert_cli_tp2_pp2_ep2_and_back_is_bitwise(tmp_path):
    _hf(tmp_path / "hf", seed=6)
    run_convert(convert_args(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir",
                              str(tmp_path / "hf"), "--save-dir", str(tmp_path / "meg"),
                              "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                              "--target-expert-parallel-size", "2"]))
    ranks = sorted(p.name for p in (tmp_path / "meg" / "release").iterdir() if p.is_dir())
    assert ranks == [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)]
    shard = torch.load(tmp_path / "meg" / "release" / "mp_rank_01_001_001" / "model_optim_rng.pt", weights_only=False)
    layer = shard["model"]["language_model"]["encoder"]
    assert layer["layers.0.self_attention.core_attention.softmax_offset"].shape == (2,)  # heads 2, 3
    assert layer["layers.0.mlp.experts.bias1"].shape == (2, 24)  # experts 2, 3; [gate | up] halves of TP rank 1
    run_convert(convert_args(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir",
                              str(tmp_path / "meg"), "--save-dir", str(tmp_path / "out")]))
    before, after = _load(tmp_path / "hf"), _load(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_mxfp4_dequantisation_equals_transformers():
    g = torch.Generator().manual_seed(8)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 6, 2), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    assert ours.shape == (3, 64, 6)
    assert torch.equal(ours, mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)  # exact in bf16


def test_mxfp4_packed_folder_reads_as_its_dequantised_weights(tmp_path):
    _hf(tmp_path / "plain", seed=7)
    tensors = _load(tmp_path / "plain")
    packed = dict(tensors)
    g = torch.Generator().manual_seed(9)
    for i in range(CONFIG["num_hidden_layers"]):
        for name, rows, cols in (("gate_up_proj", 2 * 24, 32), ("down_proj", 32, 24)):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks = torch.randint(0, 256, (4, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(122, 128, (4, rows, cols // 32), generator=g, dtype=torch.uint8)
            del packed[key]
            packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
            tensors[key] = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    for folder, state, quant in (("packed", packed, {"quant_method": "mxfp4"}), ("unpacked", tensors, None)):
        (tmp_path / folder).mkdir()
        safetensors_torch.save_file(state, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}
                                                                   if quant else cfg))
    flat = {name: state_dict_from_messages(read_hf(str(tmp_path / name))[1]) for name in ("packed", "unpacked")}
    assert sorted(flat["packed"]) == sorted(flat["unpacked"])
    for key, value in flat["unpacked"].items():
        assert torch.equal(flat["packed"][key], value), key
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "packed" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError) as info:
        read_hf(str(tmp_path / "packed"))
    assert "bitsandbytes" in str(info.value) and "\n" not in str(info.value)
