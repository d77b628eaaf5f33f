"""Memory benchmark of activation recomputation: peak memory and step time of one GPT training step per mode.

GPT 12 layers / hidden 768 / 12 heads / seq 1024 / vocab 50304 (GPT-2 small), fp32 on CPU, micro-batch 1,
Megatron's default dropout 0.1 (``--dropout 0`` for none), Megatron's FP32 optimizer (Adam), the no-pipelining
schedule. Modes: no recompute, selective
(``--recompute-activations``), full uniform (``--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1``), full block (``--recompute-method block --recompute-num-layers 12`` and 6).

Each mode runs in a fresh subprocess (so one mode's allocations cannot hide another's) with glibc's mmap threshold
pinned at 64 KiB (MALLOC_MMAP_THRESHOLD_), so that freed activation tensors go back to the OS and RSS follows
what is really allocated. In that process: build the model and optimizer, run one warm-up step (Adam's state is
created lazily), take the RSS as the baseline (weights, grads, optimizer state), reset the peak RSS
(/proc/self/clear_refs), run the timed steps and read the peak (VmHWM). Reported per mode:

* ``peak - baseline``: the activation-ish memory of a training step as the OS sees it (activations, logits,
  temporary buffers of forward and backward, the recomputation's own activations);
* ``saved``: bytes of the tensors autograd keeps for backward at the end of the forward pass, measured with
  torch.autograd.graph.saved_tensors_hooks (each storage counted once, parameters excluded; the output layer's
  logits buffer, which is reused across steps and so also sits in the baseline RSS, included): exactly what
  recomputation saves;
* ``estimate``: megatron/theoretical_memory_usage.py's activation formula for the same configuration;
* the fastest timed step (the least disturbed by other load on the machine) and its ratio to no recompute.

    python tools/benchmarks/bench_memory.py [--steps 3] [--micro-batch-size 1] [--dropout 0.1]
                            [--modes none,selective,...] [--threads N] [--markdown] [--json out.json]
                            [--timing]   (allocator at its defaults: for the step-time column)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 12, 768, 12, 1024, 50304
MB = 1024.0 * 1024.0

MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block-12": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=12),
    "full-block-6": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=6),
}
FLAGS = {
    "none": "(none)",
    "selective": "--recompute-activations",
    "full-uniform-1": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "full-block-12": "--recompute-granularity full --recompute-method block --recompute-num-layers 12",
    "full-block-6": "--recompute-granularity full --recompute-method block --recompute-num-layers 6",
}


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def estimate_activation_mb(mode: str, mbs: int, dropout: float) -> float:
    """megatron/theoretical_memory_usage.py's activation estimate for this benchmark's model in `mode`."""
    from megatron.theoretical_memory_usage import compute_activation_memory

    recompute = MODES[mode]
    args = argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ, micro_batch_size=mbs,
        ffn_hidden_size=4 * HIDDEN, kv_channels=None, padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        sequence_parallel=False, fp16=False, bf16=False, recompute_granularity=recompute.get("recompute_granularity"),
        recompute_method=recompute.get("recompute_method"), recompute_num_layers=recompute.get("recompute_num_layers"),
        distribute_saved_activations=False, swiglu=False)
    del dropout  # the formula assumes dropout masks are kept (Megatron's default 0.1)
    return compute_activation_memory(args, num_microbatches=1) / MB


def run_mode(mode: str, steps: int, mbs: int, dropout: float) -> dict[str, Any]:
    """Inside the worker process: build, warm up, measure (see the module docstring)."""
    import torch

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.core.transformer_config import TransformerConfig
    from megatron.models.gpt.model import GPTModel
    from megatron.optimizer import get_megatron_optimizer
    from megatron.optimizer.optimizer_config import OptimizerConfig

    torch.manual_seed(1234)
    model_parallel_manual_seed(1234, 0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               max_position_embeddings=SEQ, padded_vocab_size=VOCAB, hidden_dropout=dropout,
                               attention_dropout=dropout, **MODES[mode])
    state = ps.ParallelState.single()
    model = GPTModel(config, tp_group=None, pp_state=state, parallel_output=True)
    optimizer = get_megatron_optimizer([model], OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=1.0), state)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(mbs, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu_(1)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (mbs, SEQ + 1), generator=g) for _ in range(steps + 2)]
    saved = {"on": False, "storages": {}}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if saved["on"]:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:  # matmuls save their weights too: those are not activations
                saved["storages"][storage.data_ptr()] = storage.nbytes()
        return t

    def forward_step(data_iterator, m):
        data = next(data_iterator)
        tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        losses = m(tokens, position_ids, mask, labels=labels)
        saved["on"] = False  # the end of the forward pass: what autograd holds now is the activation memory

        def loss_func(out):
            loss = out.float().mean()
            return loss, {"lm loss": loss.detach()}

        return losses, loss_func

    def step(batch: torch.Tensor) -> float:
        optimizer.zero_grad()
        store = forward_backward_no_pipelining(forward_step, iter([batch]), [model], 1,
                                               grad_scale_func=optimizer.scale_loss)
        optimizer.step()
        return float(store[0]["lm loss"])

    step(batches[0])  # warm-up: creates Adam's state and the pooled buffers
    gc.collect()
    baseline_kib = _proc_status_kib("VmRSS")
    peak_reset = _reset_peak_rss()
    times, losses = [], []
    for batch in batches[1:steps + 1]:
        t = time.perf_counter()
        losses.append(step(batch))
        times.append(time.perf_counter() - t)
    peak_kib = _proc_status_kib("VmHWM")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # an extra, untimed step
        saved["on"] = True
        step(batches[-1])
    return {
        "mode": mode, "flags": FLAGS[mode], "step_s": min(times), "times": times, "losses": losses,
        "baseline_mb": baseline_kib / 1024.0, "peak_mb": peak_kib / 1024.0,
        "activation_mb": (peak_kib - baseline_kib) / 1024.0 if peak_reset else float("nan"),
        "saved_mb": sum(saved["storages"].values()) / MB, "estimate_mb": estimate_activation_mb(mode, mbs, dropout),
        "threads": torch.get_num_threads(),
    }


def _spawn(mode: str, steps: int, mbs: int, dropout: float, threads: Optional[int],
           pin_malloc: bool = True) -> dict[str, Any]:
    env = dict(os.environ)
    if pin_malloc:  # RSS follows what is allocated, at the price of page faults on every large tensor (slow)
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--steps", str(steps),
           "--micro-batch-size", str(mbs), "--dropout", str(dropout)] + (["--threads", str(threads)] if threads else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"mode {mode} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def format_table(results: list[dict[str, Any]], markdown: bool) -> str:
    ref = next((r for r in results if r["mode"] == "none"), results[0])
    head = ["mode", "flags", "step time (s)", "vs none", "peak - baseline RSS (MB)", "vs none",
            "saved for backward (MB)", "vs none", "estimate (MB)"]
    rows = []
    for r in results:
        rows.append([r["mode"], r["flags"], f"{r['step_s']:.2f}", f"{r['step_s'] / ref['step_s']:.2f}x",
                     f"{r['activation_mb']:.0f}", f"{r['activation_mb'] / ref['activation_mb']:.2f}x",
                     f"{r['saved_mb']:.0f}", f"{r['saved_mb'] / ref['saved_mb']:.2f}x", f"{r['estimate_mb']:.0f}"])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        out += ["| " + " | ".join(f"`{c}`" if i == 1 else c for i, c in enumerate(row)) + " |" for row in rows]
        return "\n".join(out)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [head, *rows])


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    p.add_argument("--modes", type=str, default="none,selective,full-uniform-1,full-block-12",
                   help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in the workers")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    p.add_argument("--timing", action="store_true",
                   help="leave glibc's allocator at its defaults: representative step times, but RSS then keeps "
                        "freed memory, so only the 'saved for backward' memory column is meaningful")
    p.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if a.worker is not None:
        if a.threads:
            import torch

            torch.set_num_threads(a.threads)
        print("RESULT " + json.dumps(run_mode(a.worker, a.steps, a.micro_batch_size, a.dropout)), flush=True)
        return []
    results = []
    for mode in modes:
        t = time.perf_counter()
        results.append(_spawn(mode, a.steps, a.micro_batch_size, a.dropout, a.threads, pin_malloc=not a.timing))
        print(f"  {mode}: done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    print(f"GPT {LAYERS} layers / hidden {HIDDEN} / {HEADS} heads / seq {SEQ} / vocab {VOCAB}, fp32 CPU, "
          f"micro-batch {a.micro_batch_size}, dropout {a.dropout}, {a.steps} timed steps, {results[0]['threads']} threads; "
          f"baseline RSS (weights + grads + Adam state) {results[0]['baseline_mb']:.0f} MB")
    print(format_table(results, a.markdown))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
