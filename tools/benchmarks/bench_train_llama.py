"""Benchmark one Llama-style training step: megatron-lite vs Hugging Face LlamaForCausalLM + torch.optim.AdamW.

Same model in both (6 layers, hidden 384, 6 query heads in 2 KV groups, SwiGLU ffn 1024, RMSNorm, RoPE, untied output
layer, no biases, seq 512, micro batch 4, vocab 32000, fp32, no dropout, AdamW lr 1e-4 wd 0.01, grad clipping 1.0),
the same initial weights (HF's, converted with megatron.models.gpt.hf_llama, so the first losses agree), the same
random token batches, measured in the same process with the two frameworks' steps interleaved (both see the same
machine load): a few warm-up steps, then timed steps (median). Prints tokens/s of each, the ratio, and the MFU of
each against a fp32 matmul peak measured here (FLOPs counted from the shapes: 3x forward, no recomputation). It also
prints the ratio of process CPU time per step: on a machine shared with other jobs, wall time mostly measures waiting
for a core, while CPU time (with --threads 1) still measures each stack's own work; the ratio of each stack's
fastest step (wall and CPU) is printed too, the least disturbed estimate when other jobs share the cores.

    python tools/benchmarks/bench_train_llama.py [--steps 5] [--warmup 2] [--threads N] [--json out.json]
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

from bench_common import gpt_forward_step, hf_train_step, matmul_peak_flops  # noqa: E402

LAYERS, HIDDEN, HEADS, GROUPS, FFN, SEQ, MBS, VOCAB = 6, 384, 6, 2, 1024, 512, 4, 32000


def model_flops_per_step() -> float:
    """Forward GEMM FLOPs x 3 (forward + backward), causal attention counted in full as Megatron does."""
    tokens = MBS * SEQ
    head_dim = HIDDEN // HEADS
    qkv = HIDDEN * (HEADS + 2 * GROUPS) * head_dim
    per_layer = 2 * tokens * (qkv + HIDDEN * HIDDEN + 3 * HIDDEN * FFN) + 2 * 2 * tokens * SEQ * HIDDEN
    return 3.0 * (LAYERS * per_layer + 2 * tokens * HIDDEN * VOCAB)


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g) for _ in range(n)]


def build_hf():
    """LlamaForCausalLM (SDPA attention) + torch.optim.AdamW in a plain loop."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=SEQ,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_dropout=0.0,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).float()
    model.train()
    return model, hf_train_step(model)


def build_megatron(hf_model):
    """GPTModel (Llama layers) with the HF model's weights + Megatron FP32 optimizer + the no-pipelining schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.gpt.hf_llama import hf_llama_to_megatron_state_dict, megatron_config_from_hf_llama
    from megatron.models.gpt.model import GPTModel
    from megatron.optimizer import get_megatron_optimizer
    from megatron.optimizer.optimizer_config import OptimizerConfig

    model_parallel_manual_seed(1234, 0)
    config = megatron_config_from_hf_llama(hf_model.config)
    state = ps.ParallelState.single()
    model = GPTModel(config, tp_group=None, pp_state=state, parallel_output=True)
    model.load_state_dict(hf_llama_to_megatron_state_dict(hf_model.state_dict(), config))
    optimizer = get_megatron_optimizer([model], OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=1.0), state)
    forward_step = gpt_forward_step(SEQ, MBS)

    def step(batch: torch.Tensor) -> float:
        optimizer.zero_grad()
        store = forward_backward_no_pipelining(forward_step, iter([batch]), [model], 1,
                                               grad_scale_func=optimizer.scale_loss)
        optimizer.step()
        return float(store[0]["lm loss"])

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
    hf = build_hf()
    frameworks = {"megatron": build_megatron(hf[0]), "hf": hf}
    # Interleave the steps (alternating which framework goes first) so that both see the same machine load.
    times: dict[str, list[float]] = {name: [] for name in frameworks}
    cpu: dict[str, list[float]] = {name: [] for name in frameworks}
    losses: dict[str, list[float]] = {name: [] for name in frameworks}
    for i, batch in enumerate(batches):
        order = list(frameworks) if i % 2 == 0 else list(reversed(frameworks))
        for name in order:
            t, c = time.perf_counter(), time.process_time()
            losses[name].append(frameworks[name][1](batch))
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
    for name, (model, _step) in frameworks.items():
        n_params = sum(q.numel() for q in model.parameters())
        med = statistics.median(times[name])
        cpu_med = statistics.median(cpu[name])
        results[name] = {"params": n_params, "step_s": med, "tokens_per_s": tokens / med, "cpu_s": cpu_med,
                         "step_min_s": min(times[name]), "cpu_min_s": min(cpu[name]),
                         "mfu": flops / med / peak, "first_loss": losses[name][0], "last_loss": losses[name][-1]}
        print(f"{name:9s} params {n_params / 1e6:.2f}M  step {med:.3f} s (median of {len(times[name])})  "
              f"{tokens / med:8.1f} tokens/s  MFU {100 * flops / med / peak:.1f}%  CPU {cpu_med:.3f} s/step  "
              f"loss {losses[name][0]:.4f} -> {losses[name][-1]:.4f}", flush=True)
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
