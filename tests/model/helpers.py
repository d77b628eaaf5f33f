"""Shared builders for the model tests: tiny configs, seeded GPT models and a batch with Megatron's causal mask."""
from __future__ import annotations

import torch

from megatron.checkpoint.conversion.hf_format import read_hf
from megatron.checkpoint.conversion.interchange import state_dict_from_messages
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer_config import TransformerConfig
from megatron.models.gpt.model import GPTModel

VOCAB = 64
SEQ = 8
BATCH = 2


def tiny_config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=VOCAB,
        max_position_embeddings=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(config: TransformerConfig, seed: int = 1234, tp_rank: int = 0, **kwargs) -> GPTModel:
    model_parallel_manual_seed(seed, tp_rank)
    return GPTModel(config, **kwargs)


def batch(seed: int = 7, batch_size: int = BATCH, seq: int = SEQ, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(seq).unsqueeze(0).expand(batch_size, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    return ids, pos, mask, labels


def twin_from_hf_folder(folder) -> tuple:
    """Our GPTModel (eval mode) read from a Hugging Face folder by the converter's HF reader, and the reader's
    ModelMeta: the twin the HF parity tests compare with `transformers`."""
    meta, stream = read_hf(str(folder))
    flat = state_dict_from_messages(stream)
    model_parallel_manual_seed(1)
    model = GPTModel(meta.config()).eval()
    model.load_state_dict(flat)
    return model, meta


def reference_pass(model: GPTModel, data: tuple) -> tuple:
    """A one-process model's logits, per-token loss and every parameter's gradient on `data` (ids, positions, mask,
    labels, as `batch()` gives): what the tensor-parallel tests compare each rank with."""
    ids, pos, mask, labels = data
    logits = model(ids, pos, mask).detach()
    loss = model(ids, pos, mask, labels=labels)
    loss.mean().backward()
    return logits, loss.detach(), {n: p.grad for n, p in model.named_parameters()}
