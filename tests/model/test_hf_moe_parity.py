"""Mixtral, Qwen2-MoE and Qwen3-MoE parity with Hugging Face (fp32, tiny offline configs): the HF folder (safetensors, Hub
layout) read by the conversion loader gives a GPTModel whose logits and KV-cache greedy generation equal
MixtralForCausalLM / Qwen2MoeForCausalLM's; writing it back with the HF saver gives the same tensors bitwise and
a folder HF loads to the same logits."""
from __future__ import annotations

import pytest
import torch

from megatron.checkpoint.conversion.hf_format import read_hf, write_hf
from megatron.checkpoint.conversion.interchange import messages_from_state_dict, state_dict_from_messages
from megatron.text_generation import generate
from tests.model.helpers import twin_from_hf_folder
from tests.model.hf_llama_helpers import causal_inputs

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, MAX_POS = 61, 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
              max_position_embeddings=MAX_POS, tie_word_embeddings=False, rope_theta=12345.0, rms_norm_eps=1e-6)
FAMILIES = {
    "mixtral_top2": ("MixtralConfig", dict(intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2moe_shared_dense_layer": ("Qwen2MoeConfig", dict(
        intermediate_size=44, moe_intermediate_size=24, shared_expert_intermediate_size=36, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen2moe_norm_topk": ("Qwen2MoeConfig", dict(
        intermediate_size=44, moe_intermediate_size=24, shared_expert_intermediate_size=36, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)),
    # Qwen3-MoE: per-head q/k norms, head_dim 12 != 32 / 4, no shared expert, a dense layer, renormalised top-k
    "qwen3moe_dense_layer": ("Qwen3MoeConfig", dict(
        intermediate_size=44, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, head_dim=12,
        mlp_only_layers=[1], norm_topk_prob=True, num_hidden_layers=4)),
}
PROMPTS = [[5, 17, 33], [9, 2, 60, 40, 3, 58, 12], [10, 1, 44, 7, 7]]


def _hf(family: str, folder, seed: int = 0):
    cls_name, kw = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**COMMON, **kw}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_((0.5 if "gate" in name and "proj" not in name else 0.15) * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def convert(*argv: str) -> None:
    """tools/checkpoint/convert.py for a GPT-type model, in this process."""
    from megatron.checkpoint.conversion.driver import convert as run
    from megatron.checkpoint.conversion.driver import parse_args

    run(parse_args(["--model-type", "GPT", *argv]))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_generation_equal_hf(family, tmp_path):
    hf = _hf(family, tmp_path / "hf")
    model, meta = twin_from_hf_folder(tmp_path / "hf")
    assert meta.config().num_moe_experts == 4
    ids, pos, mask = causal_inputs()
    with torch.no_grad():
        ours, theirs = model(ids, pos, mask), hf(input_ids=ids).logits
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= 1e-5
    new = 32 if family.startswith("qwen3") else 8
    out = generate(model, None, PROMPTS, new, greedy=True, eod_id=VOCAB - 1, use_eod_token_for_early_termination=False)
    for prompt, row in zip(PROMPTS, out["tokens"]):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert row == ref[0].tolist()


@pytest.mark.parametrize("family", ["mixtral_top2", "qwen2moe_shared_dense_layer", "qwen3moe_dense_layer"])
def test_hf_to_megatron_to_hf_round_trip_is_bitwise(family, tmp_path):
    hf = _hf(family, tmp_path / "hf", seed=4)
    meta, stream = read_hf(str(tmp_path / "hf"))
    flat = state_dict_from_messages(stream)
    summary = write_hf(meta, messages_from_state_dict(flat, meta.architecture["num_layers"]), str(tmp_path / "out"))
    assert summary["architecture"] == hf.config.architectures[0]
    load = safetensors_torch.load_file
    before, after = load(tmp_path / "hf" / "model.safetensors"), load(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    again = getattr(transformers, summary["architecture"]).from_pretrained(tmp_path / "out", attn_implementation="eager")
    again = again.float().eval()
    ids, _, _ = causal_inputs()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_convert_cli_hf_to_megatron_tp2_pp3_and_back_is_bitwise(tmp_path):
    """tools/checkpoint/convert.py's driver: Qwen2-MoE (shared expert, a dense layer) -> Megatron TP=2 x PP=3
    -> HF."""
    _hf("qwen2moe_shared_dense_layer", tmp_path / "hf", seed=5)

    convert("--loader", "hf", "--saver", "megatron", "--load-dir", str(tmp_path / "hf"), "--save-dir",
            str(tmp_path / "meg"), "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "3")
    ranks = sorted(p.name for p in (tmp_path / "meg" / "release").iterdir() if p.is_dir())
    assert ranks == [f"mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(3)]
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", str(tmp_path / "meg"), "--save-dir",
            str(tmp_path / "out"))
    load = safetensors_torch.load_file
    before, after = load(tmp_path / "hf" / "model.safetensors"), load(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_convert_cli_hf_mixtral_to_megatron_ep2_tp2_and_back_is_bitwise(tmp_path):
    """HF Mixtral -> Megatron with its experts over 2 expert ranks (x TP=2: Megatron-LM's mp_rank_TT_EEE folders,
    each holding 2 of the 4 experts) -> HF, bitwise."""
    _hf("mixtral_top2", tmp_path / "hf", seed=6)

    convert("--loader", "hf", "--saver", "megatron", "--load-dir", str(tmp_path / "hf"), "--save-dir",
            str(tmp_path / "meg"), "--target-tensor-parallel-size", "2", "--target-expert-parallel-size", "2")
    ranks = sorted(p.name for p in (tmp_path / "meg" / "release").iterdir() if p.is_dir())
    assert ranks == [f"mp_rank_{t:02d}_{e:03d}" for t in range(2) for e in range(2)]
    shard = torch.load(tmp_path / "meg" / "release" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert shard["args"].expert_model_parallel_size == 2
    w1 = shard["model"]["language_model"]["encoder"]["layers.0.mlp.experts.weight1"]
    assert w1.shape[0] == 2  # local experts 2 and 3
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", str(tmp_path / "meg"), "--save-dir",
            str(tmp_path / "out"))
    load = safetensors_torch.load_file
    before, after = load(tmp_path / "hf" / "model.safetensors"), load(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key


@pytest.mark.parametrize("family,layout", [("qwen3moe_dense_layer", ("2", "2", "2")), ("qwen3_dense", ("2", "2", "1"))])
def test_convert_cli_qwen3_tp2_pp2_and_back_is_bitwise(family, layout, tmp_path):
    """HF Qwen3-MoE -> Megatron TP=2 x PP=2 x EP=2 -> HF, and dense Qwen3 (q/k norms replicated) at TP=2 x PP=2."""
    if family == "qwen3_dense":
        from tests.model.hf_llama_helpers import hf_model

        hf_model("qwen3_head_dim", seed=7).save_pretrained(tmp_path / "hf")
    else:
        _hf(family, tmp_path / "hf", seed=7)
    tp, pp, ep = layout
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", str(tmp_path / "hf"), "--save-dir",
            str(tmp_path / "meg"), "--target-tensor-parallel-size", tp, "--target-pipeline-parallel-size", pp,
            "--target-expert-parallel-size", ep)
    shard = torch.load(sorted((tmp_path / "meg" / "release").glob("mp_rank_01_*"))[-1] / "model_optim_rng.pt",
                       weights_only=False)
    assert shard["architecture"]["qk_layernorm"] is True
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", str(tmp_path / "meg"), "--save-dir",
            str(tmp_path / "out"))
    load = safetensors_torch.load_file
    before, after = load(tmp_path / "hf" / "model.safetensors"), load(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after) and any("q_norm" in k for k in before)
    for key in before:
        assert torch.equal(before[key], after[key]), key
