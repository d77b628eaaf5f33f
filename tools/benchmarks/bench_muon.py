"""Muon vs Adam on a ~100M-parameter Llama-style model: optimizer step time, optimizer memory, loss after N steps.

Model: 12 layers, hidden 768, 12 heads (4 query groups), SwiGLU FFN 2048, RMSNorm, RoPE, untied output, vocabulary of
the shipped GPT-2 tiny BPE (5,000 entries, padded to 5,120): ~93M parameters, fp32 on CPU. Data: the shipped
OpenWebText-1000 corpus (shared/data, else tests/fixtures), tokenised here, packed into sequences of `--seq` tokens;
both optimizers see the same batches from the same initial weights. Each step: forward/backward (not timed apart),
then the optimizer step timed alone (get_megatron_optimizer's FP32Optimizer with --clip-grad 1.0). Memory: the bytes
of the optimizer state tensors (Adam: exp_avg + exp_avg_sq; Muon: momentum_buffer for 2-D weights + Adam state for
embeddings, output layer and norms). Defaults: Adam lr 3e-4, Muon lr 2e-2 (Megatron's spectral scale), wd 0.01,
constant lr after a 2-step warmup.

    python tools/benchmarks/bench_muon.py [--steps 20] [--seq 256] [--batch 4] [--threads 2] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron.core.transformer_config import TransformerConfig  # noqa: E402
from megatron.learning_rates import OptimizerParamScheduler  # noqa: E402
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.tokenizer import build_tokenizer  # noqa: E402


def corpus_tokens(limit: int) -> torch.Tensor:
    """The first `limit` tokens of OpenWebText-1000 with the GPT-2 tiny vocabulary."""
    owt = ROOT.parent.parent / "shared" / "data" / "openwebtext-1000"
    if not owt.is_dir():
        owt = Path("/work/shared/data/openwebtext-1000")
    args = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(owt / "gpt2-tiny-vocab.json"),
                              merge_file=str(owt / "gpt2-tiny-merges.txt"), tokenizer_model=None,
                              tokenizer_name_or_path=None, vocab_size=None, vocab_extra_ids=0,
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, rank=0)
    tok = build_tokenizer(args)
    ids: list = []
    with open(owt / "openwebtext-1000.jsonl") as f:
        for line in f:
            ids += tok.tokenize(json.loads(line)["text"]) + [tok.eod]
            if len(ids) >= limit:
                break
    return torch.tensor(ids[:limit])


def build_model(vocab: int, seq: int) -> GPTModel:
    cfg = TransformerConfig(num_layers=12, hidden_size=768, num_attention_heads=12, group_query_attention=True,
                            num_query_groups=4, ffn_hidden_size=2048, swiglu=True, normalization="RMSNorm",
                            position_embedding_type="rope", add_bias_linear=False, padded_vocab_size=vocab,
                            max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0,
                            share_embeddings_and_output_weights=False)
    torch.manual_seed(1234)
    return GPTModel(cfg)


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.optimizer.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)


def run(name: str, lr: float, init: dict, tokens: torch.Tensor, a: argparse.Namespace) -> dict:
    model = build_model(5120, a.seq)
    model.load_state_dict(init)
    opt = get_megatron_optimizer(model, OptimizerConfig(optimizer=name, lr=lr, weight_decay=0.01, clip_grad=1.0))
    sched = OptimizerParamScheduler(opt, 0.0, lr, lr, 2, a.steps + 1, "constant", 0.01, 0.01, a.steps, "constant")
    span = a.batch * (a.seq + 1)
    pos = torch.arange(a.seq).unsqueeze(0).expand(a.batch, a.seq)
    mask = torch.triu(torch.ones(1, 1, a.seq, a.seq, dtype=torch.bool), diagonal=1)
    step_times, losses = [], []
    for step in range(a.steps):
        chunk = tokens[step * span:(step + 1) * span].view(a.batch, a.seq + 1)
        loss = model(chunk[:, :-1], pos, mask, labels=chunk[:, 1:]).float().mean()
        loss.backward()
        start = time.perf_counter()
        opt.step()
        step_times.append(time.perf_counter() - start)
        opt.zero_grad()
        sched.step(1)
        losses.append(loss.item())
    n_params = sum(p.numel() for p in model.parameters())
    return {"optimizer": name, "lr": lr, "params": n_params, "state_MB": state_bytes(opt) / 2**20,
            "step_s_median": statistics.median(step_times[1:]), "loss_first": losses[0],
            "loss_last5_mean": statistics.mean(losses[-5:]), "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--adam-lr", type=float, default=3e-4)
    parser.add_argument("--muon-lr", type=float, default=2e-2)
    parser.add_argument("--json", type=str, default=None)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    tokens = corpus_tokens(a.steps * a.batch * (a.seq + 1))
    init = build_model(5120, a.seq).state_dict()
    rows = [run("adam", a.adam_lr, init, tokens, a), run("muon", a.muon_lr, init, tokens, a)]
    print("| optimizer | lr | params | optimizer state | optimizer step (median) | loss step 1 | loss, last 5 steps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['optimizer']} | {r['lr']:g} | {r['params'] / 1e6:.1f}M | {r['state_MB']:.0f} MB | "
              f"{r['step_s_median']:.3f} s | {r['loss_first']:.3f} | {r['loss_last5_mean']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
