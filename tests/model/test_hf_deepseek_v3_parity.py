"""DeepSeek-V3 parity with Hugging Face (fp32, tiny offline configs): a DeepseekV3ForCausalLM folder read by the
conversion loader gives a GPTModel (multi-latent attention, first-k dense, routed + shared experts in groups with the
expert bias, YaRN) whose logits equal HF's (<= 2e-5) and whose 32-token greedy KV-cache generation is HF's; writing it
back gives the same tensors bitwise."""
from __future__ import annotations

import pytest
import torch

from megatron.checkpoint.conversion.hf_format import read_hf, write_hf
from megatron.checkpoint.conversion.interchange import messages_from_state_dict, state_dict_from_messages
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.models.gpt.model import GPTModel
from megatron.text_generation import generate
from tests.model.helpers import twin_from_hf_folder
from tests.model.hf_llama_helpers import causal_inputs

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, MAX_POS = 61, 64
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8, "rope_theta": 10000.0}
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=16, qk_rope_head_dim=8,
              v_head_dim=12, qk_nope_head_dim=16, first_k_dense_replace=1, max_position_embeddings=MAX_POS,
              tie_word_embeddings=False, rms_norm_eps=1e-6)
VARIANTS = {
    # DeepSeek-V3's shape: q-lora, YaRN, 4 groups of which 2 are used, top-4, one shared expert, scaled weights
    "v3_q_lora_yarn_groups": dict(q_lora_rank=24, rope_parameters=YARN, n_group=4, topk_group=2,
                                  num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.5),
    # V2-Lite's attention: no q-lora, plain RoPE; no groups, two shared experts
    "no_q_lora_rope": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                           n_group=1, topk_group=1, num_experts_per_tok=2, n_shared_experts=2,
                           routed_scaling_factor=1.0),
}
PROMPTS = [[5, 17, 33], [9, 2, 60, 40, 3, 58, 12], [10, 1, 44, 7, 7]]


def _add_mtp_layer(folder, config) -> None:
    """Write one MTP layer into the folder as DeepSeek's releases store it (HF's model neither builds nor saves it):
    layer num_hidden_layers, a MoE decoder layer with enorm / hnorm / eh_proj / shared_head.norm and copies of the
    embedding and output layer."""
    path = folder / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    n, h = config.num_hidden_layers, config.hidden_size
    g = torch.Generator().manual_seed(7)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    tensors.update({mtp + k[len(last):]: 0.15 * torch.randn(v.shape, generator=g) for k, v in tensors.items()
                    if k.startswith(last)})
    tensors.update({mtp + "enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                    mtp + "hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                    mtp + "eh_proj.weight": 0.15 * torch.randn(h, 2 * h, generator=g),
                    mtp + "shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                    mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})


def _hf(variant: str, folder, seed: int = 0, mtp: bool = False, **changes):
    config = transformers.DeepseekV3Config(**{**COMMON, **VARIANTS[variant], **changes}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_((0.5 if name.endswith("gate.weight") else 0.15) * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(folder)
    if mtp:
        _add_mtp_layer(folder, config)
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_generation_equal_hf(variant, tmp_path):
    hf = _hf(variant, tmp_path / "hf")
    model, meta = twin_from_hf_folder(tmp_path / "hf")
    config = meta.config()
    assert config.multi_latent_attention and config.moe_layer_pattern == [0, 1, 1]
    ids, pos, mask = causal_inputs(seq=13)
    with torch.no_grad():
        ours, theirs = model(ids, pos, mask), hf(input_ids=ids).logits
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= 2e-5
    out = generate(model, None, PROMPTS, 32, greedy=True, eod_id=VOCAB - 1, use_eod_token_for_early_termination=False)
    for prompt, row in zip(PROMPTS, out["tokens"]):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert row == ref[0].tolist()


@pytest.mark.parametrize("variant", ["no_q_lora_rope"])  # q-lora: the convert.py test below
def test_hf_to_megatron_to_hf_round_trip_is_bitwise(variant, tmp_path):
    """With the MTP layer HF stores as layer num_hidden_layers (the model built from it holds the MTP block)."""
    hf = _hf(variant, tmp_path / "hf", seed=4, mtp=True)
    meta, stream = read_hf(str(tmp_path / "hf"))
    flat = state_dict_from_messages(stream)
    assert meta.config().mtp_num_layers == 1 and "mtp.layers.0.eh_proj.weight" in flat
    model_parallel_manual_seed(1)
    GPTModel(meta.config()).load_state_dict(flat)  # every tensor is one of the model's (strict)
    summary = write_hf(meta, messages_from_state_dict(flat, meta.architecture["num_layers"]), str(tmp_path / "out"))
    assert summary["architecture"] == "DeepseekV3ForCausalLM"
    load = safetensors_torch.load_file
    before, after = load(tmp_path / "hf" / "model.safetensors"), load(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    ids, _, _ = causal_inputs(seq=13)
    with torch.no_grad():
        assert torch.equal(again.float().eval()(input_ids=ids).logits, hf(input_ids=ids).logits)


def convert(*argv: str) -> None:
    """tools/checkpoint/convert.py for a GPT-type model, in this process."""
    from megatron.checkpoint.conversion.driver import convert as run
    from megatron.checkpoint.conversion.driver import parse_args

    run(parse_args(["--model-type", "GPT", *argv]))


def test_convert_cli_hf_to_megatron_tp2_pp2_ep2_and_back_is_bitwise(tmp_path):
    """HF (with its MTP layer) -> Megatron TP=2 x PP=2 x EP=2 (mp_rank_TT_PPP_EEE folders; the MTP block and the
    embedding copy it reads on the last stage) -> HF, bitwise."""
    _hf("v3_q_lora_yarn_groups", tmp_path / "hf", seed=6, mtp=True, num_hidden_layers=4)
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", str(tmp_path / "hf"), "--save-dir",
            str(tmp_path / "meg"), "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
            "--target-expert-parallel-size", "2")
    ranks = sorted(p.name for p in (tmp_path / "meg" / "release").iterdir() if p.is_dir())
    assert ranks == [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)]
    last = torch.load(tmp_path / "meg" / "release" / "mp_rank_01_001_001" / "model_optim_rng.pt", weights_only=False)
    assert last["model"]["mtp"]["layers.0.transformer_layer.mlp.experts.weight1"].shape[0] == 4  # experts 4..7
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", str(tmp_path / "meg"), "--save-dir",
            str(tmp_path / "out"))
    load = safetensors_torch.load_file
    before, after = load(tmp_path / "hf" / "model.safetensors"), load(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
