"""Tiny GPT-2-style, Llama-style and BLOOM models, source checkpoints and an independent shard merger for the
checkpoint-conversion tests."""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict

import torch

from megatron.checkpoint.conversion.interchange import ModelMeta, architecture_of, messages_from_state_dict
from megatron.checkpoint.conversion.megatron_format import write_megatron
from megatron.checkpoint.safe_load import safe_torch_load
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.tp_shards import merge_tensor_parallel_state_dicts
from megatron.models.gpt.model import GPTModel, flatten_checkpoint_state_dict

TRUE_VOCAB = 61
DIVISIBLE = 4  # make-vocab-size-divisible-by: 61 -> 64 at TP1/TP2/TP4, different padding rows per TP
SEQ = 9

FAMILIES = {
    # GPT-2 style: LayerNorm, learned positions, biases, tanh GeLU (fused bias-gelu), tied embeddings
    "gpt2": dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                 max_position_embeddings=16, layernorm_epsilon=1e-5),
    # Llama style: RMSNorm, RoPE, SwiGLU, GQA (4 groups of 2 heads), no biases, untied output layer
    "llama": dict(num_layers=4, hidden_size=32, num_attention_heads=8, ffn_hidden_size=24,
                  max_position_embeddings=16, normalization="RMSNorm", swiglu=True,
                  position_embedding_type="rope", rotary_base=50000.0, group_query_attention=True,
                  num_query_groups=4, add_bias_linear=False, bias_gelu_fusion=False,
                  share_embeddings_and_output_weights=False, layernorm_epsilon=1e-6),
    # BLOOM: ALiBi (6 heads: not a power of two, 3 per TP rank), LayerNorm after the word embeddings, 4h tanh GeLU
    "bloom": dict(num_layers=4, hidden_size=48, num_attention_heads=6, ffn_hidden_size=192,
                  max_position_embeddings=16, position_embedding_type="alibi", embed_layernorm=True),
}


def config(family: str, padded: int = 64, **overrides) -> TransformerConfig:
    kw = dict(FAMILIES[family], padded_vocab_size=padded, hidden_dropout=0.0, attention_dropout=0.0)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build(cfg: TransformerConfig, state_dict: Dict[str, torch.Tensor] = None, seed: int = 3) -> GPTModel:
    model_parallel_manual_seed(seed)
    model = GPTModel(cfg).eval()
    if state_dict is None:
        with torch.no_grad():  # non-trivial norms, biases and padding rows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                else:
                    p.copy_(0.2 * torch.randn_like(p))
    else:
        model.load_state_dict(state_dict)
    return model


def inputs(batch: int = 2, seq: int = SEQ, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TRUE_VOCAB, (batch, seq), generator=g)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    return ids, pos, mask


def logits(model: GPTModel) -> torch.Tensor:
    with torch.no_grad():
        return model(*inputs())


def meta_for(cfg: TransformerConfig, iteration=7, true_vocab=TRUE_VOCAB) -> ModelMeta:
    return ModelMeta("GPT", architecture_of(cfg), true_vocab_size=true_vocab, iteration=iteration,
                     make_vocab_size_divisible_by=DIVISIBLE, consumed_train_samples=96)


def save_source(model: GPTModel, cfg: TransformerConfig, folder: str, tp: int, pp: int, vp_layers=None,
                true_vocab=None) -> None:
    """A Megatron checkpoint of `model` at the given layout (padding rows kept when true_vocab is None)."""
    write_megatron(meta_for(cfg, true_vocab=true_vocab), messages_from_state_dict(model.state_dict(),
                                                                                  cfg.num_layers),
                   folder, tp, pp, vp_layers)


_RANK = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")
_LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.+)$")


def load_files(folder: str) -> Dict:
    """{(tp, pp): state dict} of the iteration named by the tracker (plain weights-only torch.load)."""
    text = open(os.path.join(folder, "latest_checkpointed_iteration.txt")).read().strip()
    it_dir = os.path.join(folder, "release" if text == "release" else f"iter_{int(text):07d}")
    out = {}
    for d in os.listdir(it_dir):
        m = _RANK.match(d)
        if m:
            out[(int(m.group(1)), int(m.group(2) or 0))] = safe_torch_load(
                os.path.join(it_dir, d, "model_optim_rng.pt"))
    return out


def merge_independently(folder: str, cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """Full TP=1 flat state dict of a checkpoint: Megatron's layer offsets written out here, TP merge by the
    parameters' layouts (megatron.layers.tp_shards) - no code of the converter's reader."""
    files = load_files(folder)
    tp = max(t for t, _ in files) + 1
    pp = max(p for _, p in files) + 1
    keys = sorted(k for k in files[(0, 0)] if re.fullmatch(r"model\d*", k))
    vp = len(keys)
    padded = flatten_checkpoint_state_dict(files[(0, 0)][keys[0]])[
        "language_model.embedding.word_embeddings.weight"].size(0) * tp
    layer_cfg = dataclasses.replace(cfg, padded_vocab_size=padded)
    per_chunk = cfg.num_layers // (pp * vp)
    full: Dict[str, torch.Tensor] = {}
    for p in range(pp):
        for v, key in enumerate(keys):
            shards = [flatten_checkpoint_state_dict(files[(t, p)][key]) for t in range(tp)]
            head = shards[0].get("word_embeddings.weight") is not None
            if head:
                for s in shards:
                    s.pop("word_embeddings.weight")
            merged = merge_tensor_parallel_state_dicts(shards, config=layer_cfg)
            offset = v * (cfg.num_layers // vp) + p * per_chunk
            for name, value in merged.items():
                m = _LAYER.match(name)
                full[f"language_model.encoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name] = value
    return full
