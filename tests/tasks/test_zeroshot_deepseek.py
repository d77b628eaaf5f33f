"""tasks/main.py WIKITEXT103 (sliding windows) on a DeepSeek-V3 checkpoint (multi-latent attention with q-lora and
YaRN, a dense first layer, a MoE layer with grouped sigmoid routing, the expert bias and a shared expert), converted
from a Hugging Face DeepseekV3ForCausalLM folder, equals a plain loop over that HF model."""
from __future__ import annotations

import pytest
import torch

from megatron.checkpoint.conversion.hf_format import read_hf
from megatron.checkpoint.conversion.interchange import state_dict_from_messages
from tasks.zeroshot_gpt.detokenizer import wikitext_detokenizer
from tests.tasks import helpers as H

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

STRIDE = 32
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
DEEPSEEK_FLAGS = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--position-embedding-type",
                  "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--ffn-hidden-size", "96",
                  "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "24", "--kv-lora-rank", "16",
                  "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--rope-type", "yarn",
                  "--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "1.0",
                  "--yarn-original-max-position-embeddings", "16", "--num-experts", "4", "--moe-layer-freq",
                  "([0,1])", "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
                  "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
                  "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                  "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32"]


def _run(argv: list) -> dict:
    from megatron.initialize import destroy_megatron
    from tasks.main import main

    try:
        return main(argv)
    finally:
        destroy_megatron()


@pytest.mark.slow  # evaluation processes
def test_wikitext_of_deepseek_v3_equals_hf(shared_data, tmp_path):
    config = transformers.DeepseekV3Config(
        vocab_size=H.PADDED_VOCAB, hidden_size=H.HIDDEN, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=H.LAYERS, num_attention_heads=H.HEADS, num_key_value_heads=H.HEADS, n_shared_experts=1,
        n_routed_experts=4, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=H.SEQ, rope_parameters=YARN, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    hf.save_pretrained(tmp_path / "hf")
    _, stream = read_hf(str(tmp_path / "hf"))
    ckpt = H.save_megatron_checkpoint(state_dict_from_messages(stream), tmp_path / "ckpt")
    wiki = H.write_wikitext_slice(shared_data, tmp_path / "wiki.test.tokens", 30)
    flags = H.model_flags(shared_data, ckpt) + DEEPSEEK_FLAGS + ["--micro-batch-size", "8"]
    owt = shared_data / "openwebtext-1000"
    tok = tokenizers.ByteLevelBPETokenizer(str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt"))

    res = _run(["--task", "WIKITEXT103", "--valid-data", str(wiki), "--overlapping-eval", str(STRIDE), *flags])
    ids = tok.encode(wikitext_detokenizer(wiki.read_text(encoding="utf-8"))).ids
    total = H.strided_window_loss(hf, ids, H.SEQ, STRIDE)
    assert res["avg_loss"] == pytest.approx(total / (len(ids) - 1), rel=1e-4, abs=1e-4)
