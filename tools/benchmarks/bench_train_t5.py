"""Benchmark one T5 training step and compare its MFU with a GPT step of comparable size, measured in the same run.

T5 (Megatron's T5Model, megatron/models/t5/model.py): 6 encoder + 6 decoder layers, hidden 384, 6 heads, ffn 1536,
encoder 512 / decoder 128 tokens, micro batch 4, BERT vocab 30,522 + 100 extra ids padded to 30,720, fp32, no
dropout, Megatron's fp32 AdamW (lr 1e-4, wd 0.01, clipping 1.0), pretrain_t5's loss (per-token LM loss averaged over
the target tokens); batches shaped like T5Dataset's (padded encoder inputs of 448-512 tokens, decoder inputs of
96-128 tokens, Megatron's [b, s_q, s_k] int64 encoder / causal decoder / encoder-decoder masks).
GPT (GPTModel): 12 layers (= 6 + 6), hidden 384, 6 heads, seq 512, micro batch 4, the same padded vocabulary, the
same optimizer, Megatron's GPT loss. The two steps run interleaved (both see the same machine load): warm-up steps,
then timed steps (median). MFU: Megatron's FLOPs (megatron/flops.py for GPT, t5_num_floating_point_operations for
T5; 3x forward, 2 FLOPs per multiply-add) over a fp32 matmul peak measured at the start of the run. Prints both
steps' tokens/s (T5: encoder tokens, and encoder + decoder tokens), MFU and the T5/GPT MFU ratio (goal >= 0.85).

    python tools/benchmarks/bench_train_t5.py [--steps 5] [--warmup 2] [--threads N] [--json out.json]
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
    matmul_peak_flops,
    megatron_train_step,
    run_interleaved,
)

ENC_LAYERS, DEC_LAYERS, HIDDEN, HEADS, ENC_SEQ, DEC_SEQ, MBS = 6, 6, 384, 6, 512, 128, 4
VOCAB = 30522 + 100  # BERT WordPiece + --vocab-extra-ids 100
PADDED_VOCAB = 30720  # padded to a multiple of --make-vocab-size-divisible-by 128


def _config(**kw):
    from megatron.core.transformer_config import TransformerConfig

    return TransformerConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, padded_vocab_size=PADDED_VOCAB,
                             max_position_embeddings=ENC_SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                             bias_gelu_fusion=False, **kw)


def t5_config():
    return _config(num_layers=ENC_LAYERS, encoder_num_layers=ENC_LAYERS, decoder_num_layers=DEC_LAYERS)


def gpt_config():
    return _config(num_layers=ENC_LAYERS + DEC_LAYERS)


def t5_flops() -> float:
    from megatron.models.t5.model import t5_num_floating_point_operations

    return t5_num_floating_point_operations(t5_config(), MBS, ENC_SEQ, DEC_SEQ)


def gpt_flops() -> float:
    from megatron.flops import num_floating_point_operations

    return num_floating_point_operations(gpt_config(), MBS, ENC_SEQ)


def t5_batches(n: int, seed: int = 0) -> list[dict]:
    """T5Dataset-shaped micro-batches (int64, masks 1 = attend)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        enc_len = torch.randint(448, ENC_SEQ + 1, (MBS,), generator=g)
        dec_len = torch.randint(96, DEC_SEQ + 1, (MBS,), generator=g)
        enc_valid = (torch.arange(ENC_SEQ).unsqueeze(0) < enc_len.unsqueeze(1)).long()
        dec_valid = (torch.arange(DEC_SEQ).unsqueeze(0) < dec_len.unsqueeze(1)).long()
        enc = torch.randint(5, VOCAB, (MBS, ENC_SEQ), generator=g) * enc_valid
        dec = torch.randint(5, VOCAB, (MBS, DEC_SEQ), generator=g) * dec_valid
        labels = torch.where(dec_valid.bool(), torch.randint(5, VOCAB, (MBS, DEC_SEQ), generator=g),
                             torch.full_like(dec, -1))
        out.append({"text_enc": enc, "text_dec": dec, "labels": labels, "loss_mask": dec_valid,
                    "enc_mask": enc_valid.unsqueeze(2) * enc_valid.unsqueeze(1),
                    "dec_mask": torch.tril(dec_valid.unsqueeze(2) * dec_valid.unsqueeze(1)),
                    "enc_dec_mask": dec_valid.unsqueeze(2) * enc_valid.unsqueeze(1)})
    return out


def gpt_batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MBS, ENC_SEQ + 1), generator=g) for _ in range(n)]


def build_t5():
    """T5Model + Megatron's fp32 optimizer + pretrain_t5's forward step and loss."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.t5.model import T5Model

    model_parallel_manual_seed(1234, 0)
    torch.manual_seed(1234)
    model = T5Model(t5_config(), pp_state=ps.ParallelState.single())

    def forward_step(data_iterator, m):
        b = next(data_iterator)
        output = m(b["text_enc"], b["text_dec"], b["enc_mask"], b["dec_mask"], b["enc_dec_mask"],
                   tokentype_ids=None, lm_labels=b["labels"])

        def loss_func(out):
            mask = b["loss_mask"].float()
            loss = torch.sum(out.float().view(-1) * mask.reshape(-1)) / mask.sum()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    return model, megatron_train_step(model, forward_step)


def build_gpt():
    """GPTModel + Megatron's fp32 optimizer, as bench_train_gpt.py's step."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.gpt.model import GPTModel

    model_parallel_manual_seed(1234, 0)
    torch.manual_seed(1234)
    model = GPTModel(gpt_config(), tp_group=None, pp_state=ps.ParallelState.single(), parallel_output=True)
    forward_step = gpt_forward_step(ENC_SEQ, MBS)

    return model, megatron_train_step(model, forward_step)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--with-explicit-attention", action="store_true",
                   help="also time the T5 step on the explicit softmax attention path (the path padded masks took "
                        "before SDPA learned Megatron's fully-masked rows)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    n = a.warmup + a.steps
    flops = {"t5": t5_flops(), "gpt": gpt_flops()}
    tokens = {"t5": MBS * ENC_SEQ, "gpt": MBS * ENC_SEQ}
    peak = matmul_peak_flops()
    print(f"threads: {torch.get_num_threads()}  fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s  model FLOPs/step: "
          f"T5 {flops['t5'] / 1e9:.1f} GFLOP, GPT {flops['gpt'] / 1e9:.1f} GFLOP", flush=True)
    models = {"t5": build_t5(), "gpt": build_gpt()}
    batches = {"t5": t5_batches(n), "gpt": gpt_batches(n)}
    if a.with_explicit_attention:
        models["t5-explicit"] = build_t5()
        for m in models["t5-explicit"][0].modules():
            if hasattr(m, "allow_sdpa"):
                m.allow_sdpa = False
        batches["t5-explicit"], flops["t5-explicit"], tokens["t5-explicit"] = batches["t5"], flops["t5"], tokens["t5"]
    timing = run_interleaved({name: step for name, (_m, step) in models.items()}, batches, a.warmup)
    results: dict = {"threads": torch.get_num_threads(), "peak_gflops": peak / 1e9}
    for name, (model, _step) in models.items():
        r = timing[name]
        med = r["step_s"]
        n_params = sum(q.numel() for q in model.parameters())
        results[name] = {"params": n_params, "step_s": med, "cpu_s": r["cpu_s"], "tokens_per_s": tokens[name] / med,
                         "mfu": flops[name] / med / peak, "gflops": flops[name] / 1e9, "times": r["times"],
                         "first_loss": r["losses"][0], "last_loss": r["losses"][-1]}
        extra = f" ({MBS * (ENC_SEQ + DEC_SEQ) / med:.1f} enc+dec)" if name.startswith("t5") else ""
        print(f"{name:11s} params {n_params / 1e6:.2f}M  step {med:.3f} s (median of {len(r['times'])}, CPU "
              f"{r['cpu_s']:.3f} s)  {tokens[name] / med:7.1f} tokens/s{extra}  MFU {100 * flops[name] / med / peak:.1f}%"
              f"  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}", flush=True)
    ratio = results["t5"]["mfu"] / results["gpt"]["mfu"]
    cpu_ratio = (flops["t5"] / results["t5"]["cpu_s"]) / (flops["gpt"] / results["gpt"]["cpu_s"])
    results["mfu_ratio"], results["cpu_mfu_ratio"] = ratio, cpu_ratio
    print(f"T5 MFU / GPT MFU: {ratio:.2f} (goal >= 0.85); FLOPs per process-CPU second, T5 / GPT: {cpu_ratio:.2f}",
          flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
