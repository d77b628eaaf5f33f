"""Tiny Hugging Face BLOOM models (built offline, fp32) and our GPT twins (ALiBi + --embed-layernorm)."""
from __future__ import annotations

import torch

from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.models.gpt.hf_bloom import hf_bloom_to_megatron_state_dict, megatron_config_from_hf_bloom
from megatron.models.gpt.model import GPTModel

# name -> BloomConfig kwargs: 16 heads (a power of two) and 12 heads (not one: the interleaved extra slopes).
FAMILIES = {
    "bloom_16_heads": dict(hidden_size=64, n_head=16),
    "bloom_12_heads": dict(hidden_size=48, n_head=12),
}
VOCAB = 64


def hf_model(family: str, seed: int = 0, n_layer: int = 2):
    import transformers

    config = transformers.BloomConfig(vocab_size=VOCAB, n_layer=n_layer, hidden_dropout=0.0, attention_dropout=0.0,
                                      attn_implementation="eager", **FAMILIES[family])
    torch.manual_seed(seed)
    model = transformers.BloomForCausalLM(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, weights large enough for the logits to differ
        for name, p in model.named_parameters():
            if "layernorm" in name or "ln_f" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def megatron_twin(hf, **overrides) -> GPTModel:
    """Our GPTModel with the HF BLOOM's weights (TP=1)."""
    config = megatron_config_from_hf_bloom(hf.config, max_position_embeddings=64, **overrides)
    model_parallel_manual_seed(1)
    model = GPTModel(config).eval()
    model.load_state_dict(hf_bloom_to_megatron_state_dict(hf.state_dict(), config))
    return model


def causal_inputs(batch: int = 2, seq: int = 11, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    return ids, pos, mask
