"""Sample text from a GPT checkpoint (Megatron's tools/generate_samples_gpt.py flags; runs under torchrun with TP).

Conditional:   python tools/generate_samples_gpt.py --load ckpt <model flags> --sample-input-file prompts.txt \
                   --sample-output-file out.jsonl --out-seq-length 64 --top_k 40
Unconditional: python tools/generate_samples_gpt.py --load ckpt <model flags> --num-samples 8 --genfile out.jsonl
Output: JSON lines, one per sample: {"prompt", "text" (the continuation), "tokens", "length", "finished"}.
With --inference-dynamic-batching every prompt goes to the inference engine at once (megatron/inference; sized by
--inference-dynamic-batching-*), each with its own room (--out-seq-length, capped by the context) and seed
(--seed + its index); greedy samples are the static generator's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron import global_vars  # noqa: E402
from megatron.errors import MegatronUserError, exit_on_user_error  # noqa: E402
from megatron.initialize import initialize_megatron  # noqa: E402
from megatron.settings import RandomWeightsSettings, TextGenerationSettings, add_group  # noqa: E402


class GenerateSamplesError(MegatronUserError, ValueError):
    """Bad flags or input file for generate_samples_gpt.py."""


def add_text_generate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The sampling flags and the random-weights opt-in (declared in megatron/settings/generation.py)."""
    return add_group(add_group(parser, TextGenerationSettings), RandomWeightsSettings)


def _read_prompts(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise GenerateSamplesError(f"--sample-input-file {path}: no such file")
    with open(path, encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise GenerateSamplesError(f"--sample-input-file {path} has no non-empty lines (one prompt per line)")
    return prompts


def _resolve_sampling(args: argparse.Namespace) -> Tuple[bool, float]:
    """(greedy, temperature) from the sampling flags, with one-line errors for bad ones; --temperature 0 becomes
    greedy decoding, as in the server."""
    if args.temperature < 0.0:
        raise GenerateSamplesError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0 or not 0.0 <= args.top_p <= 1.0:
        raise GenerateSamplesError(f"--top_k must be >= 0 and --top_p in [0, 1] (got {args.top_k}, {args.top_p})")
    if args.top_k > 0 and args.top_p > 0.0:
        raise GenerateSamplesError("set --top_k or --top_p, not both")
    if args.temperature == 0.0:
        if args.top_p > 0.0 or args.top_k > 1:
            raise GenerateSamplesError("--temperature 0 means greedy decoding; drop --top_k/--top_p")
        return True, 1.0
    return args.greedy, args.temperature


def _engine_records(engine_config: Any, model: Any, tokenizer: Any, args: argparse.Namespace, prompts: list[str],
                    prompt_ids: list[list[int]], max_total: int, greedy: bool, temperature: float) -> list[dict]:
    """Every prompt submitted to the inference engine at once; the records of the static loop."""
    from megatron.inference import InferenceEngine, SamplingParams
    from megatron.text_generation.engine_driver import run_to_completion

    if args.recompute:
        raise GenerateSamplesError("--recompute is the static generator's; drop it or --inference-dynamic-batching")
    engine = InferenceEngine(model, engine_config, eod=int(tokenizer.eod))
    params = [SamplingParams(max_new_tokens=min(args.out_seq_length, max_total - len(ids)), greedy=greedy,
                             temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed + i,
                             vocab_size=int(tokenizer.vocab_size)) for i, ids in enumerate(prompt_ids)]
    done = run_to_completion(engine, prompt_ids, params)
    return [dict(prompt=prompt, text=tokenizer.detokenize(c.tokens), tokens=c.tokens, length=len(ids) + len(c.tokens),
                 finished=bool(c.tokens) and c.tokens[-1] == tokenizer.eod)
            for prompt, ids, c in zip(prompts, prompt_ids, done)]


def main(argv: Optional[list[str]] = None) -> list[dict]:
    from megatron.inference import engine_config_from_args
    from megatron.text_generation import generate, load_model_for_inference
    from megatron.text_generation.model_loading import refuse_random_weights

    args = initialize_megatron(extra_args_provider=add_text_generate_args, args=argv,
                               args_defaults={"tokenizer_type": "GPT2BPETokenizer", "micro_batch_size": 1,
                                              "no_load_rng": True, "no_load_optim": True})
    refuse_random_weights(args.load, args.allow_random_weights, "generation")
    if args.sample_input_file is None and args.num_samples <= 0:
        raise GenerateSamplesError("give --sample-input-file FILE (conditional) or --num-samples N (unconditional)")
    if args.out_seq_length <= 0:
        raise GenerateSamplesError(f"--out-seq-length must be > 0, got {args.out_seq_length}")
    greedy, temperature = _resolve_sampling(args)
    tokenizer = global_vars.get_tokenizer()
    model = load_model_for_inference(args)
    if args.sample_input_file is not None:
        prompts = _read_prompts(args.sample_input_file)
        prompt_ids = [tokenizer.tokenize(p) for p in prompts]
        output = args.sample_output_file or args.sample_input_file + ".out"
    else:
        prompts = [""] * args.num_samples
        prompt_ids = [[tokenizer.eod] for _ in prompts]  # unconditional: start from end-of-document
        output = args.sample_output_file
    max_total = min(args.seq_length, args.max_position_embeddings)
    for i, ids in enumerate(prompt_ids):
        if not ids:
            prompt_ids[i] = [tokenizer.eod]
        elif len(ids) >= max_total:
            raise GenerateSamplesError(f"--sample-input-file line {i + 1}: prompt has {len(ids)} tokens, no room "
                                       f"left in --seq-length {max_total}; shorten it")
    engine_config = engine_config_from_args(args)
    records = [] if engine_config is None else _engine_records(engine_config, model, tokenizer, args, prompts,
                                                               prompt_ids, max_total, greedy, temperature)
    batch = max(1, args.micro_batch_size)
    for start in range(0, len(prompt_ids) if engine_config is None else 0, batch):
        chunk = prompt_ids[start: start + batch]
        to_generate = min(args.out_seq_length, max_total - max(len(p) for p in chunk))
        out = generate(model, tokenizer, chunk, to_generate, greedy=greedy, top_k=args.top_k, top_p=args.top_p,
                       temperature=temperature, random_seed=args.seed + start, use_kv_cache=not args.recompute)
        for j, (tokens, length) in enumerate(zip(out["tokens"], out["lengths"])):
            new = tokens[len(chunk[j]):]
            finished = bool(new) and new[-1] == tokenizer.eod
            records.append(dict(prompt=prompts[start + j], text=tokenizer.detokenize(new), tokens=new,
                                length=length, finished=finished))
    if args.rank == 0:
        lines = [json.dumps(r, ensure_ascii=False) for r in records]
        if output:
            with open(output, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
            print(f"wrote {len(records)} samples to {output}", flush=True)
        else:
            print("\n".join(lines), flush=True)
    return records


if __name__ == "__main__":
    exit_on_user_error(main)
