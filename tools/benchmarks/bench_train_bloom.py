"""Benchmark one BLOOM training step: megatron-lite vs Hugging Face BloomForCausalLM + torch.optim.AdamW.

Same model in both (6 layers, hidden 384, 6 heads (ALiBi, not a power of two), 4h tanh-GeLU MLP with biases,
LayerNorm after the word embeddings, tied output layer, seq 512, micro batch 4, vocab 32000, fp32, no dropout, AdamW
lr 1e-4 wd 0.01, grad clipping 1.0), the same initial weights (HF's, converted with megatron.models.gpt.hf_bloom, so the
first losses agree), the same
random token batches, measured in the same process with the two frameworks' steps interleaved (both see the same
machine load): a few warm-up steps, then timed steps (median). Prints tokens/s of each, the ratio, and the MFU of
each against a fp32 matmul peak measured here (FLOPs counted from the shapes: 3x forward, no recomputation). It also
prints the ratio of process CPU time per step: on a machine shared with other jobs, wall time mostly measures waiting
for a core, while CPU time (with --threads 1) still measures each stack's own work; the ratio of each stack's
fastest step (wall and CPU) is printed too, the least disturbed estimate when other jobs share the cores.

    python tools/benchmarks/bench_train_bloom.py [--steps 5] [--warmup 2] [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (  # noqa: E402
    add_common_args,
    gpt_forward_step,
    hf_train_step,
    matmul_peak_flops,
    megatron_train_step,
    run_interleaved,
)

LAYERS, HIDDEN, HEADS, SEQ, MBS, VOCAB = 6, 384, 6, 512, 4, 32000
FFN = 4 * HIDDEN


def model_flops_per_step() -> float:
    """Forward GEMM FLOPs x 3 (forward + backward), causal attention counted in full as Megatron does."""
    tokens = MBS * SEQ
    per_layer = 2 * tokens * (3 * HIDDEN * HIDDEN + HIDDEN * HIDDEN + 2 * HIDDEN * FFN) + 2 * 2 * tokens * SEQ * HIDDEN
    return 3.0 * (LAYERS * per_layer + 2 * tokens * HIDDEN * VOCAB)


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g) for _ in range(n)]


def build_hf():
    """BloomForCausalLM (its own baddbmm attention: BLOOM has no SDPA path in transformers) + torch.optim.AdamW."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(1234)
    cfg = BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, layer_norm_epsilon=1e-5,
                      hidden_dropout=0.0, attention_dropout=0.0, attn_implementation="eager")
    model = BloomForCausalLM(cfg).float()
    model.train()
    return model, hf_train_step(model)


def build_megatron(hf_model):
    """GPTModel (BLOOM: ALiBi, embedding LayerNorm) with the HF model's weights + Megatron FP32 optimizer + the
    no-pipelining schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.gpt.hf_bloom import hf_bloom_to_megatron_state_dict, megatron_config_from_hf_bloom
    from megatron.models.gpt.model import GPTModel

    model_parallel_manual_seed(1234, 0)
    config = megatron_config_from_hf_bloom(hf_model.config, max_position_embeddings=SEQ)
    model = GPTModel(config, tp_group=None, pp_state=ps.ParallelState.single(), parallel_output=True)
    model.load_state_dict(hf_bloom_to_megatron_state_dict(hf_model.state_dict(), config))
    return model, megatron_train_step(model, gpt_forward_step(SEQ, MBS))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tokens = MBS * SEQ
    flops = model_flops_per_step()
    peak = matmul_peak_flops()
    print(f"threads: {torch.get_num_threads()}  fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s  "
          f"model FLOPs/step: {flops / 1e9:.1f} GFLOP", flush=True)
    results = {"threads": torch.get_num_threads(), "peak_gflops": peak / 1e9, "tokens_per_step": tokens}
    hf = build_hf()
    frameworks = {"megatron": build_megatron(hf[0]), "hf": hf}
    runs = run_interleaved({name: step for name, (_model, step) in frameworks.items()},
                           _batches(a.warmup + a.steps), a.warmup)
    for name, (model, _step) in frameworks.items():
        r = runs[name]
        n_params = sum(q.numel() for q in model.parameters())
        med, cpu_med, losses = r["step_s"], r["cpu_s"], r["losses"]
        results[name] = {"params": n_params, "step_s": med, "tokens_per_s": tokens / med, "cpu_s": cpu_med,
                         "step_min_s": min(r["times"]), "cpu_min_s": min(r["cpu_times"]),
                         "mfu": flops / med / peak, "first_loss": losses[0], "last_loss": losses[-1]}
        print(f"{name:9s} params {n_params / 1e6:.2f}M  step {med:.3f} s (median of {len(r['times'])})  "
              f"{tokens / med:8.1f} tokens/s  MFU {100 * flops / med / peak:.1f}%  CPU {cpu_med:.3f} s/step  "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    ratio = results["megatron"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    results["ratio"] = ratio
    results["cpu_ratio"] = results["hf"]["cpu_s"] / results["megatron"]["cpu_s"]
    results["min_ratio"] = results["hf"]["step_min_s"] / results["megatron"]["step_min_s"]
    results["cpu_min_ratio"] = results["hf"]["cpu_min_s"] / results["megatron"]["cpu_min_s"]
    print(f"megatron-lite / HF tokens/s: {ratio:.2f}x (process CPU time per step: {results['cpu_ratio']:.2f}x; "
          f"fastest steps: wall {results['min_ratio']:.2f}x, CPU {results['cpu_min_ratio']:.2f}x)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
