"""Benchmark the DeepSeek-V3 family on CPU: multi-latent attention's KV cache and decoding against the same model with
plain multi-head attention, and one training step against Hugging Face DeepseekV3ForCausalLM + AdamW.

Model (both parts): 4 layers (the first dense, ffn 1024), hidden 384, 8 heads of MLA (q-lora 192, kv-lora 128, head
64 + rope 32, value 64), 8 SwiGLU experts of ffn 256 in 4 groups (top-2 within the best group, sigmoid scores with the expert
bias, weights x 2.5) and one shared expert, RMSNorm, YaRN x4, untied output layer, vocab 32000, fp32, no dropout.

1. KV cache and decoding: the bytes the KV cache holds per token (all layers, read from the inference cache after a
   prompt) and greedy decoding tokens/s (batch 4, prompt 64, 64 new tokens, KV cache) of the MLA model and of the same
   model with plain multi-head attention (8 heads of 96 channels, the q/k width of MLA's heads).
2. Training: one step (seq 512, micro batch 2, AdamW lr 1e-4 wd 0.01, clipping 1.0) of ours and of HF's model from the
   same weights (HF's, written as safetensors and read by our HF loader, so the first losses agree), the same token
   batches, interleaved in one process (bench_common.run_interleaved): median tokens/s and the ratio.

    python tools/benchmarks/bench_deepseek.py [--steps 5] [--warmup 2] [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (  # noqa: E402
    add_common_args,
    gpt_forward_step,
    hf_train_step,
    megatron_train_step,
    run_interleaved,
)

from megatron.checkpoint.conversion.hf_format import read_hf  # noqa: E402
from megatron.checkpoint.conversion.interchange import state_dict_from_messages  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_manual_seed  # noqa: E402
from megatron.core.transformer_config import TransformerConfig  # noqa: E402
from megatron.layers.inference_params import InferenceParams  # noqa: E402
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.text_generation import generate  # noqa: E402

LAYERS, HIDDEN, HEADS, FFN, MOE_FFN, EXPERTS, TOPK, SEQ, MBS, VOCAB = 4, 384, 8, 1024, 256, 8, 2, 512, 2, 32000
HF_CONFIG = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
                 n_routed_experts=EXPERTS, routed_scaling_factor=2.5, kv_lora_rank=128, q_lora_rank=192,
                 qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, n_group=4, topk_group=1,
                 num_experts_per_tok=TOPK, first_k_dense_replace=1, max_position_embeddings=SEQ,
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": SEQ // 4,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                  "rope_theta": 10000.0},
                 tie_word_embeddings=False, attention_dropout=0.0)
DECODE_BATCH, PROMPT, NEW_TOKENS = 4, 64, 64


def build_hf():
    """DeepseekV3ForCausalLM (SDPA attention) + torch.optim.AdamW."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(1234)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**HF_CONFIG, attn_implementation="sdpa")).float()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn_like(b))
    model.train()
    return model, hf_train_step(model)


def build_megatron(hf_model) -> GPTModel:
    """Our GPTModel (MLA, DeepSeek MoE) with the HF model's weights, through the HF safetensors loader."""
    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(folder)
        meta, stream = read_hf(folder)
        flat = state_dict_from_messages(stream)
    model_parallel_manual_seed(1234, 0)
    model = GPTModel(meta.config())
    model.load_state_dict(flat)
    return model


def plain_attention_twin(config: TransformerConfig) -> GPTModel:
    """The same model with plain multi-head attention (heads of the MLA q/k width) and plain RoPE."""
    fields = {k: getattr(config, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                              "max_position_embeddings", "padded_vocab_size", "normalization",
                                              "swiglu", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
                                              "moe_layer_freq", "moe_shared_expert_intermediate_size",
                                              "moe_router_score_function", "moe_router_topk_scaling_factor",
                                              "layernorm_epsilon", "share_embeddings_and_output_weights")}
    plain = TransformerConfig(**fields, kv_channels=config.qk_head_dim + config.qk_pos_emb_head_dim,
                              position_embedding_type="rope", add_bias_linear=False, hidden_dropout=0.0,
                              attention_dropout=0.0, bias_gelu_fusion=False)
    model_parallel_manual_seed(1234, 0)
    return GPTModel(plain)


def kv_cache_bytes_per_token(model: GPTModel) -> int:
    """Bytes of the KV cache per token and sequence, all layers (after a prompt through the model)."""
    params = InferenceParams(1, PROMPT)
    ids = torch.randint(0, VOCAB, (1, PROMPT))
    pos = torch.arange(PROMPT).unsqueeze(0)
    mask = torch.ones(1, 1, PROMPT, PROMPT, dtype=torch.bool).triu(1)
    with torch.no_grad():
        model.eval()(ids, pos, mask, inference_params=params)
    total = sum(t.numel() * t.element_size() for entry in params.key_value_memory_dict.values() for t in entry)
    return total // PROMPT


def decode_tokens_per_s(model: GPTModel, reps: int = 3) -> float:
    """Greedy KV-cache decoding tokens/s (best of `reps`): DECODE_BATCH prompts of PROMPT tokens, NEW_TOKENS each."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, VOCAB - 1, (DECODE_BATCH, PROMPT), generator=g).tolist()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        generate(model.eval(), None, prompts, NEW_TOKENS, greedy=True, eod_id=VOCAB - 1,
                 use_eod_token_for_early_termination=False)
        best = min(best, time.perf_counter() - t)
    return DECODE_BATCH * NEW_TOKENS / best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    hf_model, hf_step = build_hf()
    ours = build_megatron(hf_model)
    plain = plain_attention_twin(ours.config)
    results: dict = {"threads": torch.get_num_threads()}
    for name, model in (("mla", ours), ("mha", plain)):
        results[name] = {"kv_bytes_per_token": kv_cache_bytes_per_token(model),
                         "decode_tokens_per_s": decode_tokens_per_s(model)}
        print(f"{name}: KV cache {results[name]['kv_bytes_per_token']} bytes/token, decoding "
              f"{results[name]['decode_tokens_per_s']:.1f} tokens/s", flush=True)
    results["kv_ratio"] = results["mha"]["kv_bytes_per_token"] / results["mla"]["kv_bytes_per_token"]
    results["decode_ratio"] = results["mla"]["decode_tokens_per_s"] / results["mha"]["decode_tokens_per_s"]
    print(f"MLA's KV cache is {results['kv_ratio']:.1f}x smaller; decoding {results['decode_ratio']:.2f}x MHA's "
          "tokens/s", flush=True)
    ours.train()
    tokens = MBS * SEQ
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g) for _ in range(a.warmup + a.steps)]
    runs = run_interleaved({"megatron": megatron_train_step(ours, gpt_forward_step(SEQ, MBS)), "hf": hf_step},
                           batches, a.warmup)
    for name in ("megatron", "hf"):
        r = runs[name]
        results[name] = {"step_s": r["step_s"], "tokens_per_s": tokens / r["step_s"], "first_loss": r["losses"][0],
                         "last_loss": r["losses"][-1]}
        print(f"{name:9s} step {r['step_s']:.3f} s  {tokens / r['step_s']:8.1f} tokens/s  loss "
              f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}", flush=True)
    results["train_ratio"] = results["megatron"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    print(f"megatron-lite / HF training tokens/s: {results['train_ratio']:.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
