"""Benchmark one GPT training step: megatron-lite vs Hugging Face GPT2LMHeadModel + torch.optim.AdamW.

Same model in both (6 layers, hidden 384, 6 heads, seq 512, micro batch 4, vocab 50304, fp32, no dropout,
tied embeddings, AdamW lr 1e-4 wd 0.01, grad clipping 1.0), same random token batches, measured in the same process
with the two frameworks' steps interleaved (so both see the same machine load): a few warm-up steps, then timed
steps (median). Prints tokens/s of each, the ratio, and the MFU of each against a fp32 matmul peak measured here
(Megatron's FLOPs formula: 3x forward, no recomputation).

    python tools/benchmarks/bench_train_gpt.py [--steps 5] [--warmup 2] [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import gpt_forward_step, matmul_peak_flops  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, MBS, VOCAB = 6, 384, 6, 512, 4, 50304


def model_flops_per_step(layers: int = LAYERS, hidden: int = HIDDEN, seq: int = SEQ, mbs: int = MBS,
                         vocab: int = VOCAB) -> float:
    from megatron.core.transformer_config import TransformerConfig
    from megatron.flops import num_floating_point_operations

    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=HEADS,
                               max_position_embeddings=seq, padded_vocab_size=vocab)
    return num_floating_point_operations(config, mbs, seq)


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g) for _ in range(n)]


def build_megatron():
    """GPTModel + Megatron FP32 optimizer + the no-pipelining schedule, single process."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.core.transformer_config import TransformerConfig
    from megatron.models.gpt.model import GPTModel
    from megatron.optimizer import get_megatron_optimizer
    from megatron.optimizer.optimizer_config import OptimizerConfig

    torch.manual_seed(1234)
    model_parallel_manual_seed(1234, 0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               max_position_embeddings=SEQ, padded_vocab_size=VOCAB, hidden_dropout=0.0,
                               attention_dropout=0.0)
    state = ps.ParallelState.single()
    model = GPTModel(config, tp_group=None, pp_state=state, parallel_output=True)
    optimizer = get_megatron_optimizer([model], OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=1.0), state)
    forward_step = gpt_forward_step(SEQ, MBS)

    def step(batch: torch.Tensor) -> float:
        optimizer.zero_grad()
        store = forward_backward_no_pipelining(forward_step, iter([batch]), [model], 1,
                                               grad_scale_func=optimizer.scale_loss)
        optimizer.step()
        return float(store[0]["lm loss"])

    return model, step


def build_hf():
    """GPT2LMHeadModel (SDPA attention) + torch.optim.AdamW in a plain loop."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(batch: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(out.loss.detach())

    return model, step


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="timed steps per framework")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per framework")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    batches = _batches(a.warmup + a.steps)
    tokens = MBS * SEQ
    flops = model_flops_per_step()
    peak = matmul_peak_flops()
    print(f"threads: {torch.get_num_threads()}  fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s  "
          f"model FLOPs/step: {flops / 1e9:.1f} GFLOP", flush=True)
    results = {"threads": torch.get_num_threads(), "peak_gflops": peak / 1e9, "tokens_per_step": tokens}
    frameworks = {"megatron": build_megatron(), "hf": build_hf()}
    # Interleave the steps (alternating which framework goes first) so that both see the same machine load.
    times: dict[str, list[float]] = {name: [] for name in frameworks}
    losses: dict[str, list[float]] = {name: [] for name in frameworks}
    for i, batch in enumerate(batches):
        order = list(frameworks) if i % 2 == 0 else list(reversed(frameworks))
        for name in order:
            t = time.perf_counter()
            losses[name].append(frameworks[name][1](batch))
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t)
    for name, (model, _step) in frameworks.items():
        n_params = sum(q.numel() for q in model.parameters())
        med = statistics.median(times[name])
        results[name] = {"params": n_params, "step_s": med, "tokens_per_s": tokens / med,
                         "mfu": flops / med / peak, "first_loss": losses[name][0], "last_loss": losses[name][-1]}
        print(f"{name:9s} params {n_params / 1e6:.2f}M  step {med:.3f} s (median of {len(times[name])})  "
              f"{tokens / med:8.1f} tokens/s  MFU {100 * flops / med / peak:.1f}%  loss {losses[name][0]:.3f} -> "
              f"{losses[name][-1]:.3f}", flush=True)
    ratio = results["megatron"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    results["ratio"] = ratio
    print(f"megatron-lite / HF tokens/s: {ratio:.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
