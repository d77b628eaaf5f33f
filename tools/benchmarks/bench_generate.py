"""Benchmark greedy decoding: megatron.text_generation.generate (KV cache) vs Hugging Face GPT2LMHeadModel.generate.

Same weights (converted with megatron.models.gpt.hf_gpt2), same prompts (one batch of equal-length random token
prompts, so HF needs no padding), greedy, use_cache=True on the HF side, fp32, eos disabled so both generate exactly
--new-tokens tokens per row. The two runs are interleaved (same machine load); the median of --reps timed runs after
a warm-up is reported as generated tokens per second (batch * new tokens / wall time, prefill included), and the
generated tokens are checked identical.

    python tools/benchmarks/bench_generate.py [--layers 6 --hidden 512 --heads 8 --batch 4 --prompt 32
                                               --new-tokens 64 --reps 3 --threads N --json out.json]
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

VOCAB = 50304


def build(args: argparse.Namespace):
    import transformers

    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.core.transformer_config import TransformerConfig
    from megatron.models.gpt.hf_gpt2 import hf_gpt2_config_kwargs, megatron_gpt_to_hf_state_dict
    from megatron.models.gpt.model import GPTModel

    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               padded_vocab_size=VOCAB, max_position_embeddings=1024, hidden_dropout=0.0,
                               attention_dropout=0.0, layernorm_epsilon=1e-5, init_method_std=0.2)
    model_parallel_manual_seed(1234)
    ours = GPTModel(config, parallel_output=False).eval()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_gpt2_config_kwargs(config))).eval()
    hf.load_state_dict(megatron_gpt_to_hf_state_dict(ours.state_dict_for_save_checkpoint(), config), strict=False)
    return ours, hf


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
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
    prompts = torch.randint(0, VOCAB, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    prompt_lists = prompts.tolist()
    mask = torch.ones_like(prompts)

    def run_ours() -> torch.Tensor:
        return generate_tokens(ours, prompt_lists, args.new_tokens, eod_id=VOCAB - 1, greedy=True,
                               use_eod_token_for_early_termination=False).tokens

    def run_hf() -> torch.Tensor:
        return hf.generate(prompts, attention_mask=mask, max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, do_sample=False, use_cache=True, eos_token_id=None,
                           pad_token_id=0)

    with torch.no_grad():
        same = torch.equal(run_ours(), run_hf())  # also the warm-up
        times: dict[str, list[float]] = {"ours": [], "hf": []}
        for _ in range(args.reps):
            for name, fn in (("ours", run_ours), ("hf", run_hf)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    n_tokens = args.batch * args.new_tokens
    result = {name: n_tokens / statistics.median(ts) for name, ts in times.items()}
    result = dict(ours_tokens_per_s=result["ours"], hf_tokens_per_s=result["hf"],
                  speedup=result["ours"] / result["hf"], identical_tokens=same, threads=torch.get_num_threads(),
                  config=vars(args))
    print(f"greedy decode, {args.layers} layers, hidden {args.hidden}, vocab {VOCAB}, batch {args.batch}, "
          f"prompt {args.prompt}, {args.new_tokens} new tokens, {torch.get_num_threads()} threads")
    print(f"  megatron-lite (KV cache): {result['ours_tokens_per_s']:8.1f} tokens/s")
    print(f"  HF generate (use_cache) : {result['hf_tokens_per_s']:8.1f} tokens/s")
    print(f"  speedup {result['speedup']:.2f}x, identical tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
