"""Builders for the zero-shot evaluation tests: a tiny GPT saved as a Megatron checkpoint and its CLI flags.

The model uses the 5,000-entry GPT-2 vocabulary of openwebtext-1000 (padded to 5,120), random weights with a
larger spread than the default init so that logits are far from uniform.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from megatron.models.gpt.model import GPTModel

LAYERS, HIDDEN, HEADS, SEQ, PADDED_VOCAB = 2, 64, 4, 64, 5120


def tiny_config(tp: int = 1) -> TransformerConfig:
    return TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             padded_vocab_size=PADDED_VOCAB, max_position_embeddings=SEQ, hidden_dropout=0.0,
                             attention_dropout=0.0, tensor_model_parallel_size=tp)


def random_state_dict(seed: int = 0, std: float = 0.15) -> dict:
    """Flat TP=1 Megatron GPT state dict with random weights (LayerNorms perturbed around 1/0)."""
    torch.manual_seed(seed)
    model = GPTModel(tiny_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    return {k: v.clone() for k, v in model.state_dict().items()}


def save_megatron_checkpoint(flat: dict, directory: Path, tp: int = 1, iteration: int = 10) -> Path:
    """Write Megatron's layout (tracker file + iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt) for `tp` ranks."""
    shards = split_tensor_parallel_state_dict(flat, tp) if tp > 1 else [flat]
    for rank, shard in enumerate(shards):
        path = directory / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": shard, "iteration": iteration, "checkpoint_version": 3.0}, path)
    (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return directory


def model_flags(shared_data: Path, load: Path, tp: int = 1) -> list[str]:
    owt = shared_data / "openwebtext-1000"
    return ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(owt / "gpt2-tiny-vocab.json"), "--merge-file", str(owt / "gpt2-tiny-merges.txt"),
            "--load", str(load), "--no-load-optim", "--no-load-rng", "--tensor-model-parallel-size", str(tp),
            "--distributed-backend", "gloo", "--hidden-dropout", "0", "--attention-dropout", "0"]


def write_wikitext_slice(shared_data: Path, out: Path, num_lines: int) -> Path:
    lines = (shared_data / "wikitext-103" / "wiki.test.tokens").read_text(encoding="utf-8").splitlines(True)
    out.write_text("".join(lines[:num_lines]), encoding="utf-8")
    return out


def write_lambada_slice(shared_data: Path, out: Path, num_lines: int) -> Path:
    with open(shared_data / "lambada" / "lambada_test.jsonl", encoding="utf-8") as f:
        lines = [next(f) for _ in range(num_lines)]
    out.write_text("".join(lines), encoding="utf-8")
    return out


def write_jsonl(texts: list[str], out: Path) -> Path:
    out.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return out


def strided_window_loss(hf, ids: list, seq: int, stride: int) -> float:
    """The summed loss of a Hugging Face causal LM over every target of `ids` once, each with as much left context as
    a window of `seq` tokens moved by `stride` allows (Megatron's WIKITEXT103 --overlapping-eval): the reference the
    zero-shot tests compare tasks/main.py's average loss with."""
    n_targets, covered, start, total = len(ids) - 1, 0, 0, 0.0
    with torch.no_grad():
        while covered < n_targets:
            end = min(start + seq, n_targets)  # targets start..end-1 are ids[start+1..end]
            logp = torch.log_softmax(hf(input_ids=torch.tensor([ids[start:end]])).logits[0].double(), -1)
            losses = -logp.gather(1, torch.tensor(ids[start + 1:end + 1])[:, None])[:, 0]
            total += float(losses[covered - start:].sum())
            covered, start = end, start + stride
    return total
