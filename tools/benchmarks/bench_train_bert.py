"""Benchmark one BERT training step: megatron-lite vs Hugging Face MegatronBertForPreTraining + torch.optim.AdamW.

Same model in both (6 layers, hidden 384, 6 heads, ffn 1536, seq 512, micro batch 4, BERT vocab 30,522 padded to
Megatron's 30,592 in both, erf GeLU, binary head, fp32, no dropout, AdamW lr 1e-4 wd 0.01, clipping 1.0), the same
initial weights (ours, converted with megatron.models.bert.hf, so the first losses agree), the same BERT-shaped
batches (padded sequences of 448-512 tokens, 15% masked positions, token types, sentence-order labels), measured in
the same process with the two steps interleaved (both see the same machine load): warm-up steps, then timed steps
(median). Loss = masked-LM loss over the masked positions + sentence-order loss in both. Prints tokens/s of each
(padded tokens, micro batch x seq), the ratio, and the MFU of each against a fp32 matmul peak measured here.

    python tools/benchmarks/bench_train_bert.py [--steps 5] [--warmup 2] [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import matmul_peak_flops  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, MBS, VOCAB, PADDED_VOCAB = 6, 384, 6, 512, 4, 30522, 30592
FFN = 4 * HIDDEN


def model_flops_per_step() -> float:
    """Forward GEMM FLOPs x 3 (forward + backward): layers, attention, LM-head transform and the vocab projection."""
    tokens = MBS * SEQ
    per_layer = 2 * tokens * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * FFN) + 2 * 2 * tokens * SEQ * HIDDEN
    return 3.0 * (LAYERS * per_layer + 2 * tokens * HIDDEN * HIDDEN + 2 * tokens * HIDDEN * PADDED_VOCAB)


def _batches(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(448, SEQ + 1, (MBS,), generator=g)
        pad = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()
        text = torch.randint(5, VOCAB, (MBS, SEQ), generator=g) * pad
        types = (torch.arange(SEQ).unsqueeze(0) >= (lengths // 2).unsqueeze(1)).long() * pad
        masked = (torch.rand(MBS, SEQ, generator=g) < 0.15) & pad.bool()
        labels = torch.where(masked, torch.randint(5, VOCAB, (MBS, SEQ), generator=g), torch.full_like(text, -1))
        out.append({"text": text, "types": types, "padding_mask": pad, "labels": labels,
                    "loss_mask": masked.long(), "is_random": torch.randint(0, 2, (MBS,), generator=g)})
    return out


def build_megatron():
    """BertModel + Megatron FP32 optimizer + the no-pipelining schedule + pretrain_bert's loss."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.core.transformer_config import TransformerConfig
    from megatron.models.bert.model import BertModel
    from megatron.optimizer import get_megatron_optimizer
    from megatron.optimizer.optimizer_config import OptimizerConfig

    model_parallel_manual_seed(1234, 0)
    torch.manual_seed(1234)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               padded_vocab_size=PADDED_VOCAB, max_position_embeddings=SEQ, hidden_dropout=0.0,
                               attention_dropout=0.0, bias_gelu_fusion=False)
    state = ps.ParallelState.single()
    model = BertModel(config, pp_state=state)
    optimizer = get_megatron_optimizer([model], OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=1.0), state)

    def forward_step(data_iterator, m):
        b = next(data_iterator)
        output = m(b["text"], b["padding_mask"], tokentype_ids=b["types"], lm_labels=b["labels"])

        def loss_func(out):
            lm_loss_, sop_logits = out
            mask = b["loss_mask"].float()
            lm = torch.sum(lm_loss_.float().view(-1) * mask.view(-1)) / mask.sum()
            sop = F.cross_entropy(sop_logits.view(-1, 2).float(), b["is_random"].view(-1), ignore_index=-1)
            return lm + sop, {"loss": (lm + sop).detach()}

        return output, loss_func

    def step(batch: dict) -> float:
        optimizer.zero_grad()
        store = forward_backward_no_pipelining(forward_step, iter([batch]), [model], 1,
                                               grad_scale_func=optimizer.scale_loss)
        optimizer.step()
        return float(store[0]["loss"])

    return model, config, step


def build_hf(model, config):
    """MegatronBertForPreTraining with the same weights + torch.optim.AdamW in a plain loop."""
    from transformers import MegatronBertConfig, MegatronBertForPreTraining

    from megatron.models.bert.hf import hf_megatron_bert_config_kwargs, megatron_bert_to_hf_state_dict

    hf = MegatronBertForPreTraining(MegatronBertConfig(**hf_megatron_bert_config_kwargs(config))).float()
    hf.load_state_dict(megatron_bert_to_hf_state_dict(model.state_dict_for_save_checkpoint(), config))
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.01)

    def step(b: dict) -> float:
        opt.zero_grad(set_to_none=True)
        out = hf(input_ids=b["text"], attention_mask=b["padding_mask"], token_type_ids=b["types"],
                 labels=b["labels"].masked_fill(b["labels"] < 0, -100),
                 next_sentence_label=b["is_random"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        return float(out.loss.detach())

    return hf, step


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
    model, config, meg_step = build_megatron()
    frameworks = {"megatron": (model, meg_step), "hf": build_hf(model, config)}
    times: dict[str, list[float]] = {name: [] for name in frameworks}
    losses: dict[str, list[float]] = {name: [] for name in frameworks}
    for i, batch in enumerate(batches):
        order = list(frameworks) if i % 2 == 0 else list(reversed(frameworks))
        for name in order:
            t = time.perf_counter()
            losses[name].append(frameworks[name][1](batch))
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t)
    for name, (m, _step) in frameworks.items():
        n_params = sum(q.numel() for q in m.parameters())
        med = statistics.median(times[name])
        results[name] = {"params": n_params, "step_s": med, "tokens_per_s": tokens / med,
                         "mfu": flops / med / peak, "first_loss": losses[name][0], "last_loss": losses[name][-1]}
        print(f"{name:9s} params {n_params / 1e6:.2f}M  step {med:.3f} s (median of {len(times[name])})  "
              f"{tokens / med:8.1f} tokens/s  MFU {100 * flops / med / peak:.1f}%  loss {losses[name][0]:.4f} -> "
              f"{losses[name][-1]:.4f}", flush=True)
    ratio = results["megatron"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    results["ratio"] = ratio
    print(f"megatron-lite / HF tokens/s: {ratio:.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
