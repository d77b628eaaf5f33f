"""Packed vs padded training on chat-like data: tokens of real content per second.

A chat dataset's conversations have a long-tailed length distribution (log-normal, median ~`--median` tokens,
clipped to the sequence length). Padded: every conversation in a row of its own, padded to --seq-length (what
training without packing does). Packed: conversations placed greedily (first fit, longest first) into rows of
--seq-length, each row a `PackedSeqParams` (per-document causal attention and positions; on CPU one causal SDPA
call per document). Both train the same Llama-style model (RMSNorm, SwiGLU, RoPE, GQA), fp32, forward + backward +
SGD step per micro-batch of `--micro-batch-size` rows, with the per-token loss (sum over the real tokens / their
count, so the two see the same loss). Reported per layout: rows, share of padding, wall time of one epoch over the
conversations and real tokens per second; then the speed-up.

`--attention`: the choice of the CPU path. Attention alone (forward + backward, 8 heads of 16) over the packed rows:
the documents' block-diagonal mask through one SDPA call per row against a loop of causal SDPA calls, one per
document (what the model runs on CPU).

    python tools/benchmarks/bench_packing.py [--docs 96] [--seq-length 512] [--median 80] [--micro-batch-size 4]
                                              [--epochs 2] [--threads N] [--attention] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from megatron.core.packed_seq_params import from_cu_seqlens  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_manual_seed  # noqa: E402
from megatron.core.transformer_config import TransformerConfig  # noqa: E402
from megatron.models.gpt.model import GPTModel  # noqa: E402

VOCAB = 1024


def lengths(docs: int, median: float, seq: int, seed: int = 0) -> list[int]:
    """Log-normal conversation lengths (sigma 0.9: a long tail), clipped to 8..seq."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(math.log(median) + 0.9 * torch.randn(docs, generator=g))
    return [int(min(seq, max(8, round(float(x))))) for x in raw]


def pack(sizes: list[int], seq: int) -> list[list[int]]:
    """First-fit decreasing: the indices of the conversations in each row."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        for r, room in enumerate(free):
            if sizes[i] <= room:
                rows[r].append(i)
                free[r] -= sizes[i]
                break
        else:
            rows.append([i])
            free.append(seq - sizes[i])
    return rows


def micro_batches(sizes: list[int], rows: list[list[int]], seq: int, mbs: int, packed: bool) -> list[tuple]:
    """(tokens, labels, loss mask, PackedSeqParams or None) per micro-batch."""
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, VOCAB, (n + 1,), generator=g) for n in sizes]
    out = []
    for start in range(0, len(rows), mbs):
        group = rows[start:start + mbs]
        tokens = torch.zeros(len(group), seq, dtype=torch.long)
        labels = torch.zeros_like(tokens)
        mask = torch.zeros(len(group), seq)
        cu = torch.full((len(group), max(len(r) for r in group) + 1), seq, dtype=torch.int32)
        for b, row in enumerate(group):
            offset = 0
            cu[b, 0] = 0
            for k, i in enumerate(row):
                n = sizes[i]
                tokens[b, offset:offset + n], labels[b, offset:offset + n] = docs[i][:-1], docs[i][1:]
                mask[b, offset:offset + n] = 1.0
                offset += n
                cu[b, k + 1] = offset
            cu[b, len(row) + 1:] = offset
        out.append((tokens, labels, mask, from_cu_seqlens(cu) if packed else None))
    return out


def model(seq: int, hidden: int, layers: int) -> GPTModel:
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=8,
                               group_query_attention=True, num_query_groups=2, ffn_hidden_size=hidden * 8 // 3,
                               swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                               add_bias_linear=False, share_embeddings_and_output_weights=False,
                               padded_vocab_size=VOCAB, max_position_embeddings=seq, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model_parallel_manual_seed(1234)
    return GPTModel(config)


def epoch(net: GPTModel, batches: list[tuple], seq: int) -> float:
    """Seconds for forward + backward + SGD step over every micro-batch."""
    start = time.perf_counter()
    for tokens, labels, mask, packed in batches:
        positions = None if packed is not None else torch.arange(seq).expand(tokens.size(0), seq)
        extra = {} if packed is None else {"packed_seq_params": packed}
        losses = net(tokens, positions, None, labels=labels, **extra)
        loss = (losses * mask).sum() / mask.sum()
        loss.backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= 1e-3 * p.grad
                p.grad = None
    return time.perf_counter() - start


def attention_paths(sizes: list[int], rows: list[list[int]], seq: int, repeats: int = 3) -> dict[str, float]:
    """Seconds of attention forward + backward over every packed row: masked SDPA per row vs per-document SDPA."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    g = torch.Generator().manual_seed(2)
    times = {"mask": float("inf"), "per_document": float("inf")}
    for _ in range(repeats):
        for path in times:
            start = time.perf_counter()
            for row in rows:
                q, k, v = (torch.randn(1, 8, seq, 16, generator=g, requires_grad=True) for _ in range(3))
                cu = torch.tensor([0] + [sizes[i] for i in row]).cumsum(0)
                if path == "mask":
                    packed = from_cu_seqlens(cu)
                    out = sdpa(q, k, v, attn_mask=~packed.attention_mask(1, seq))
                else:
                    out = torch.cat([sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=2)
                out.sum().backward()
            times[path] = min(times[path], time.perf_counter() - start)
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = lengths(args.docs, args.median, args.seq_length)
    real = sum(sizes)
    layouts = {"padded": [[i] for i in range(len(sizes))], "packed": pack(sizes, args.seq_length)}
    net = model(args.seq_length, args.hidden, args.layers)
    result: dict[str, Any] = {"docs": args.docs, "real_tokens": real, "seq_length": args.seq_length}
    for name, rows in layouts.items():
        batches = micro_batches(sizes, rows, args.seq_length, args.micro_batch_size, name == "packed")
        epoch(net, batches[:1], args.seq_length)  # warm-up
        seconds = min(epoch(net, batches, args.seq_length) for _ in range(args.epochs))
        padding = 1.0 - real / (len(rows) * args.seq_length)
        result[name] = {"rows": len(rows), "padding": padding, "seconds": seconds, "tokens_per_s": real / seconds}
        print(f"{name:7s} rows {len(rows):4d}  padding {100 * padding:5.1f}%  epoch {seconds:7.2f} s  "
              f"real tokens/s {real / seconds:9.1f}", flush=True)
    result["speedup"] = result["packed"]["tokens_per_s"] / result["padded"]["tokens_per_s"]
    if args.attention:
        result["attention"] = attention_paths(sizes, layouts["packed"], args.seq_length)
        print("attention over the packed rows, forward + backward: block-diagonal mask "
              f"{result['attention']['mask']:.3f} s, per-document loop {result['attention']['per_document']:.3f} s")
    print(f"packed / padded real tokens/s: {result['speedup']:.2f}x "
          f"({args.docs} conversations, {real} real tokens, median {args.median}, seq {args.seq_length})")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=96)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--median", type=float, default=80.0)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
