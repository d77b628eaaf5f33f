"""Benchmark the lm-eval adapter: loglikelihood requests/s of our MegatronLM vs lm-eval's own HF backend (HFLM).

Both run lm-eval's `loglikelihood` on the same N distinct LAMBADA-style requests (passage prefix -> next word, from
the shipped local task's data, cut at the last word, the one before, ... to reach N) with the same weights: a random GPT (GPT-2 vocabulary) and
its GPT2LMHeadModel conversion (cut to the real vocabulary). The log-likelihoods are checked equal (1e-4) and the
ratio printed. Run from the repository root: `python tools/benchmarks/bench_eval_harness.py [--requests 500]`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron.core.transformer_config import TransformerConfig  # noqa: E402
from megatron.models.gpt.hf_gpt2 import hf_gpt2_config_kwargs, megatron_gpt_to_hf_state_dict  # noqa: E402
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer  # noqa: E402
from tasks.eval_harness import require_lm_eval  # noqa: E402
from tests.fixtures import wide_data  # noqa: E402


class Req:
    def __init__(self, *args):
        self.args = args


def requests(n: int) -> list[Req]:
    path = ROOT / "tasks" / "eval_harness" / "local_tasks" / "data" / "lambada_sample.jsonl"
    texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    for cut in range(10**6):  # the last word, then each earlier word: distinct requests
        for text in texts:
            words = text.split(" ")
            k = len(words) - 1 - cut
            if k >= 1 and len(out) < n:
                out.append(Req(" ".join(words[:k]), " " + words[k]))
        if len(out) == n:
            return out
    raise ValueError(f"cannot build {n} distinct requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    args = parser.parse_args()
    require_lm_eval()
    import transformers
    from lm_eval.models.huggingface import HFLM

    from tasks.eval_harness.adapter import MegatronLM

    if args.threads:
        torch.set_num_threads(args.threads)
    bpe = wide_data() / "gpt2-bpe"
    tok = GPT2BPETokenizer(str(bpe / "gpt2-vocab.json"), str(bpe / "gpt2-merges.txt"))
    vocab = tok.vocab_size
    padded = (vocab + 127) // 128 * 128
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
                               padded_vocab_size=padded, max_position_embeddings=args.seq, hidden_dropout=0.0,
                               attention_dropout=0.0, init_method_std=0.05)
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    hf_config = transformers.GPT2Config(**{**hf_gpt2_config_kwargs(config), "vocab_size": vocab},
                                        bos_token_id=tok.eod, eos_token_id=tok.eod)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    sd = megatron_gpt_to_hf_state_dict(model.state_dict_for_save_checkpoint(), config)
    sd = {k: v[:vocab] if k in ("transformer.wte.weight", "lm_head.weight") else v for k, v in sd.items()}
    hf.load_state_dict(sd, strict=False)
    hf_tok = transformers.GPT2TokenizerFast(vocab=str(bpe / "gpt2-vocab.json"), merges=str(bpe / "gpt2-merges.txt"),
                                            eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                            unk_token="<|endoftext|>")
    reqs = requests(args.requests)
    ours_lm = MegatronLM(model, tok, max_length=args.seq, batch_size=args.batch_size, progress=False)
    ref_lm = HFLM(pretrained=hf, tokenizer=hf_tok, batch_size=args.batch_size, device="cpu", max_length=args.seq)
    ours_lm.loglikelihood(reqs[: args.batch_size], disable_tqdm=True)  # warm-up
    ref_lm.loglikelihood(reqs[: args.batch_size], disable_tqdm=True)
    start = time.perf_counter()
    ours = ours_lm.loglikelihood(reqs, disable_tqdm=True)
    t_ours = time.perf_counter() - start
    start = time.perf_counter()
    ref = ref_lm.loglikelihood(reqs, disable_tqdm=True)
    t_ref = time.perf_counter() - start
    worst = max(abs(a[0] - b[0]) for a, b in zip(ours, ref))
    greedy_equal = all(a[1] == b[1] for a, b in zip(ours, ref))
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {vocab} (padded {padded}), max length {args.seq}, "
          f"batch {args.batch_size}, torch threads {torch.get_num_threads()}")
    print(f"{len(reqs)} loglikelihood requests: MegatronLM {len(reqs) / t_ours:.1f} req/s ({t_ours:.2f} s), "
          f"lm-eval HFLM {len(reqs) / t_ref:.1f} req/s ({t_ref:.2f} s): {t_ref / t_ours:.2f}x")
    print(f"max |log-likelihood difference| {worst:.2e}, greedy flags equal: {greedy_equal}")
    if worst > 1e-3 or not greedy_equal:
        sys.exit("results differ")


if __name__ == "__main__":
    main()
