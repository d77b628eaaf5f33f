"""Tiny Hugging Face Llama / Mistral / Qwen2 models (built offline, fp32) and their Megatron twins."""
from __future__ import annotations

import torch

from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.models.gpt.hf_llama import hf_llama_to_megatron_state_dict, megatron_config_from_hf_llama
from megatron.models.gpt.model import GPTModel

# name -> (HF config class name, kwargs). Odd sizes, rope_theta != 10000, explicit head_dim != hidden/heads.
FAMILIES = {
    "llama_mha": ("LlamaConfig", dict(hidden_size=40, num_attention_heads=5, num_key_value_heads=5,
                                      intermediate_size=37, rope_theta=5000.0, rms_norm_eps=1e-6)),
    "llama_gqa": ("LlamaConfig", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                      intermediate_size=50, rope_theta=123456.0, rms_norm_eps=1e-5)),
    "llama_mqa_head_dim": ("LlamaConfig", dict(hidden_size=36, num_attention_heads=4, num_key_value_heads=1,
                                               head_dim=12, intermediate_size=29, rope_theta=20000.0)),
    "mistral_gqa": ("MistralConfig", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=44, rope_theta=1e6, sliding_window=64)),
    "qwen2_qkv_bias": ("Qwen2Config", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=36, rope_theta=1e6)),
    # Qwen3: per-head q/k norms, head_dim 12 != 32 / 4; sliding windows (HF's S keys = --window-size S-1,0)
    "qwen3_head_dim": ("Qwen3Config", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                           intermediate_size=36, rope_theta=1e6, rms_norm_eps=1e-6)),
    "mistral_window8": ("MistralConfig", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                              intermediate_size=44, rope_theta=1e6, sliding_window=8)),
    "qwen3_window_layers": ("Qwen3Config", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                intermediate_size=36, use_sliding_window=True, sliding_window=5,
                                                max_window_layers=1)),
}
VOCAB = 61
MAX_POS = 64


def hf_model(family: str, seed: int = 0, **extra):
    import transformers

    cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, cls_name)(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=MAX_POS,
                                             tie_word_embeddings=False, attn_implementation="eager",
                                             **{**kwargs, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, weights large enough for the logits to differ
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def megatron_twin(hf, **overrides) -> GPTModel:
    """A Megatron GPTModel with the HF model's weights (TP=1)."""
    config = megatron_config_from_hf_llama(hf.config, **overrides)
    model_parallel_manual_seed(1)
    model = GPTModel(config).eval()
    model.load_state_dict(hf_llama_to_megatron_state_dict(hf.state_dict(), config))
    return model


def causal_inputs(batch: int = 2, seq: int = 11, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    return ids, pos, mask
