"""Benchmark greedy decoding of a Llama-style model with GQA: megatron.text_generation (KV cache holding the query
groups' K/V) vs Hugging Face LlamaForCausalLM.generate(use_cache=True).

Same weights (HF's, converted with megatron.models.gpt.hf_llama), same prompts (one batch of equal-length random
token prompts, so HF needs no padding), greedy, fp32, eos disabled so both generate exactly --new-tokens tokens per
row. The two runs are interleaved (same machine load); the median of --reps timed runs after a warm-up is reported
as generated tokens per second (batch * new tokens / wall time, prefill included), and the generated tokens are
checked identical. The ratio of process CPU time is printed too: on a machine shared with other jobs, wall time mostly
measures waiting for a core, while CPU time (with --threads 1) still measures each stack's own work.

    python tools/benchmarks/bench_generate_llama.py [--layers 6 --hidden 384 --heads 6 --groups 2 --ffn 1024
        --vocab 32000 --batch 4 --prompt 32 --new-tokens 64 --reps 3 --threads N --json out.json]
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


def build(args: argparse.Namespace):
    import transformers

    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.gpt.hf_llama import hf_llama_to_megatron_state_dict, megatron_config_from_hf_llama
    from megatron.models.gpt.model import GPTModel

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.groups, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=args.rope_theta, tie_word_embeddings=False, initializer_range=0.2,
        attn_implementation="sdpa")
    torch.manual_seed(1234)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    config = megatron_config_from_hf_llama(cfg)
    model_parallel_manual_seed(1234)
    ours = GPTModel(config, parallel_output=False).eval()
    ours.load_state_dict(hf_llama_to_megatron_state_dict(hf.state_dict(), config))
    return ours, hf


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--groups", type=int, default=2, help="KV heads (query groups)")
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from megatron.text_generation import generate_tokens

    ours, hf = build(args)
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    prompt_lists = prompts.tolist()
    mask = torch.ones_like(prompts)

    def run_ours() -> torch.Tensor:
        return generate_tokens(ours, prompt_lists, args.new_tokens, eod_id=args.vocab - 1, greedy=True,
                               use_eod_token_for_early_termination=False).tokens

    def run_hf() -> torch.Tensor:
        return hf.generate(prompts, attention_mask=mask, max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, do_sample=False, use_cache=True, eos_token_id=None,
                           pad_token_id=0)

    with torch.no_grad():
        a, b = run_ours(), run_hf()  # also the warm-up
        same = torch.equal(a, b)
        first_diff = None if same else int((a != b).any(0).nonzero()[0]) if a.shape == b.shape else -1
        times: dict[str, list[float]] = {"ours": [], "hf": []}
        cpu: dict[str, list[float]] = {"ours": [], "hf": []}
        for i in range(args.reps):
            order = (("ours", run_ours), ("hf", run_hf))
            for name, fn in (order if i % 2 == 0 else order[::-1]):
                t, c = time.perf_counter(), time.process_time()
                fn()
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
    n_tokens = args.batch * args.new_tokens
    rate = {name: n_tokens / statistics.median(ts) for name, ts in times.items()}
    cpu_ratio = statistics.median(cpu["hf"]) / statistics.median(cpu["ours"])
    result = dict(ours_tokens_per_s=rate["ours"], hf_tokens_per_s=rate["hf"], speedup=rate["ours"] / rate["hf"],
                  cpu_time_speedup=cpu_ratio, identical_tokens=same, first_differing_position=first_diff, threads=torch.get_num_threads(),
                  config=vars(args))
    print(f"greedy decode, Llama-style: {args.layers} layers, hidden {args.hidden}, {args.heads} heads in "
          f"{args.groups} KV groups, vocab {args.vocab}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads")
    print(f"  megatron-lite (KV cache): {result['ours_tokens_per_s']:8.1f} tokens/s")
    print(f"  HF generate (use_cache) : {result['hf_tokens_per_s']:8.1f} tokens/s")
    print(f"  speedup {result['speedup']:.2f}x (process CPU time: {cpu_ratio:.2f}x), identical tokens: {same}"
          + ("" if same else f" (first difference at position {first_diff})"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
