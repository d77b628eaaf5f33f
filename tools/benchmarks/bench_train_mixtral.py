"""Benchmark one Mixtral-style training step: megatron-lite's MoE vs Hugging Face MixtralForCausalLM + AdamW.

Same model in both (4 layers, hidden 384, 6 query heads in 2 KV groups, 8 SwiGLU experts of ffn 1024, top-2
routing, RMSNorm, RoPE, untied output layer, no biases, seq 512, micro batch 2, vocab 32000, fp32, no dropout, no
router loss in either, AdamW lr 1e-4 wd 0.01, grad clipping 1.0), the same initial weights (HF's, written as
safetensors and read by our HF loader, so the first losses agree), the same random token batches, the two steps
interleaved in one process (both see the same machine load): warm-up steps, then timed steps (median). Prints
tokens/s of each and the ratio, the ratio of process CPU time per step, and the share of one MoE layer's forward
time spent outside the expert MLPs (routing: gate, top-k, softmax; dispatch: permutation into padded expert groups
and back). HF's experts: transformers 5 defaults to its `grouped_mm` implementation (torch's grouped GEMM over
tokens sorted by expert; on CPU with torch >= 2.9), `--hf-experts eager` selects its Python loop over experts.
Ours: batched GEMMs over tokens grouped by expert, in runs of experts padded to the run's largest group.

    python tools/benchmarks/bench_train_mixtral.py [--steps 5] [--warmup 2] [--threads N] [--hf-experts eager]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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

LAYERS, HIDDEN, HEADS, GROUPS, FFN, EXPERTS, TOPK, SEQ, MBS, VOCAB = 4, 384, 6, 2, 1024, 8, 2, 512, 2, 32000


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g) for _ in range(n)]


def build_hf(experts: str | None = None):
    """MixtralForCausalLM (SDPA attention; experts as transformers chooses, or `experts`) + torch.optim.AdamW."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(1234)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=SEQ,
                        num_local_experts=EXPERTS, num_experts_per_tok=TOPK, rms_norm_eps=1e-5, rope_theta=1e6,
                        tie_word_embeddings=False, attention_dropout=0.0, attn_implementation="sdpa",
                        **({"experts_implementation": experts} if experts else {}))
    model = MixtralForCausalLM(cfg).float()
    model.train()
    return model, hf_train_step(model)


def build_megatron(hf_model):
    """GPTModel with MoE layers and the HF model's weights (through the HF safetensors loader)."""
    from megatron.checkpoint.conversion.hf_format import read_hf
    from megatron.checkpoint.conversion.interchange import state_dict_from_messages
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.gpt.model import GPTModel

    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(folder)
        meta, stream = read_hf(folder)
        flat = state_dict_from_messages(stream)
    model_parallel_manual_seed(1234, 0)
    model = GPTModel(meta.config(max_position_embeddings=SEQ))
    model.load_state_dict(flat)
    model.train()
    return model, megatron_train_step(model, gpt_forward_step(SEQ, MBS))


def routing_dispatch_share(model, reps: int = 30) -> dict:
    """Process CPU time of one MoE layer's forward, of its router alone and of its expert MLPs alone (the batched GEMMs
    and the activation on the already grouped rows, `GroupedExperts.compute`) on the same tokens, measured back to
    back `reps` times; the share is the median over the reps of (layer - expert MLPs) / layer (pairs taken together
    so that load changes between reps cancel). The rest is routing and dispatch (permutation into padded expert
    groups and back)."""
    from megatron.layers.moe import MoELayer

    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    x = torch.randn(SEQ, MBS, HIDDEN)
    captured = {}
    compute = layer.experts.compute

    def capture(*args):
        captured["args"] = args
        return compute(*args)

    total, experts, router, share, routing_share = [], [], [], [], []
    with torch.no_grad():
        layer.experts.compute = capture
        for _ in range(reps):
            t0 = time.process_time()
            layer(x)
            t1 = time.process_time()
            compute(*captured["args"])
            t2 = time.process_time()
            layer.router(x.view(-1, HIDDEN), SEQ, MBS)
            t3 = time.process_time()
            total.append(t1 - t0)
            experts.append(t2 - t1)
            router.append(t3 - t2)
            share.append((total[-1] - experts[-1]) / total[-1])
            routing_share.append(router[-1] / total[-1])
        del layer.experts.compute
    return {"moe_layer_s": statistics.median(total), "experts_s": statistics.median(experts),
            "router_s": statistics.median(router), "routing_dispatch_share": statistics.median(share),
            "routing_share": statistics.median(routing_share)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--hf-experts", default=None, choices=["eager", "grouped_mm", "batched_mm"],
                   help="HF's experts implementation (default: transformers' choice, grouped_mm in transformers 5)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tokens = MBS * SEQ
    hf_model, hf_step = build_hf(a.hf_experts)
    ours, our_step = build_megatron(hf_model)
    runs = run_interleaved({"megatron": our_step, "hf": hf_step}, _batches(a.warmup + a.steps), a.warmup)
    results = {"threads": torch.get_num_threads(), "tokens_per_step": tokens,
               "hf_experts": getattr(hf_model.config, "_experts_implementation", None)}
    print(f"HF experts implementation: {results['hf_experts']}", flush=True)
    for name, model in (("megatron", ours), ("hf", hf_model)):
        r = runs[name]
        results[name] = {"params": sum(q.numel() for q in model.parameters()), "step_s": r["step_s"],
                         "tokens_per_s": tokens / r["step_s"], "cpu_s": r["cpu_s"], "first_loss": r["losses"][0],
                         "last_loss": r["losses"][-1]}
        print(f"{name:9s} step {r['step_s']:.3f} s (median of {len(r['times'])})  {tokens / r['step_s']:8.1f} "
              f"tokens/s  CPU {r['cpu_s']:.3f} s/step  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
              flush=True)
    results["ratio"] = results["megatron"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    results["cpu_ratio"] = results["hf"]["cpu_s"] / results["megatron"]["cpu_s"]
    results.update(routing_dispatch_share(ours))
    print(f"megatron-lite / HF tokens/s: {results['ratio']:.2f}x (process CPU time per step: "
          f"{results['cpu_ratio']:.2f}x)", flush=True)
    print(f"MoE layer forward {results['moe_layer_s'] * 1e3:.1f} CPU ms, expert GEMMs {results['experts_s'] * 1e3:.1f} "
          f"ms: routing + dispatch share {100 * results['routing_dispatch_share']:.1f}% (routing alone "
          f"{100 * results['routing_share']:.1f}%)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
