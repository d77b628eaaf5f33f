"""Tiny GPT models and prompts shared by the text-generation tests."""
from __future__ import annotations

import torch

from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer_config import TransformerConfig
from megatron.models.gpt.model import GPTModel

VOCAB = 128
PROMPTS = [[5, 17, 33], [9, 2, 71, 40, 3, 88, 12], [100, 1, 64, 7, 7]]  # different lengths, batched together


def tiny_config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=VOCAB,
                  max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2,
                  layernorm_epsilon=1e-5)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(seed: int = 1234, tp_rank: int = 0, **kwargs) -> GPTModel:
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in ("tensor_model_parallel_size",)}
    model_parallel_manual_seed(seed, tp_rank)
    return GPTModel(tiny_config(**overrides), **kwargs).eval()


def full_logits(model: GPTModel, tokens: list[int]) -> torch.Tensor:
    """Logits [s, v] of one sequence through a plain full forward (no cache)."""
    ids = torch.tensor([tokens])
    n = ids.size(1)
    pos = torch.arange(n).unsqueeze(0)
    mask = torch.ones(1, 1, n, n, dtype=torch.bool).triu(1)
    with torch.no_grad():
        return model(ids, pos, mask)[0].float()
