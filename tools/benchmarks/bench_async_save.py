"""How long the training loop is blocked per checkpoint save, --async-save against the synchronous save.

A ~110M-parameter GPT (12 layers, hidden 768, 12 heads, vocab 32000; fp32, Megatron's Adam optimizer, so each save
writes the weights and two moments: ~1.3 GB) trains in one process and saves (megatron.compat.save_checkpoint, the
training loop's save, into ``--save-dir`` on disk). Blocked time of a save = the wall time the loop spends in the save
call plus, with --async-save, in the per-iteration ``maybe_finalize_async_save`` calls while the write is in flight and
in the optimizer steps' waits for the background copy of the state (megatron/core/saved_state.py).
After a synchronous save the loop trains ``--steps-between`` steps; after an asynchronous one it trains until the
checkpoint is published (as with a save interval longer than the write), and the steps taken meanwhile are timed:
they share the machine with the writer, so the report gives the mean step time of both modes next to the blocked
time, and the time from the save call until the checkpoint was published. The first save of each mode is a
warm-up; the mean over the others is reported, with the ratio async / sync (target: <= 0.25). Sync and async
alternate save by save so that both see the same machine load.

    python tools/benchmarks/bench_async_save.py [--saves 4] [--steps-between 3] [--format torch|torch_dist]
                                                [--save-dir DIR] [--threads N] [--json F]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 12, 768, 12, 64, 32000


def _args(save_dir: str, fmt: str) -> argparse.Namespace:
    from megatron.arguments import parse_args, validate_args

    argv = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--save", save_dir, "--ckpt-format", fmt, "--no-save-rng"]
    args = parse_args(args=argv)
    args.rank = 1  # quiet argument dump
    validate_args(args, {})
    args.padded_vocab_size = VOCAB
    return args


def _trainer(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model, optimizer, step()) of the GPT in `args`."""
    import torch

    from megatron.arguments import core_transformer_config_from_args
    from megatron.models.gpt.model import GPTModel
    from megatron.optimizer import get_megatron_optimizer
    from megatron.optimizer.optimizer_config import OptimizerConfig

    torch.manual_seed(0)
    model = GPTModel(core_transformer_config_from_args(args), parallel_output=False)
    optimizer = get_megatron_optimizer(model, OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=1.0))
    pos = torch.arange(SEQ).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)

    def step() -> None:
        ids = torch.randint(0, VOCAB, (1, SEQ + 1))
        optimizer.zero_grad()
        model(ids[:, :-1], pos, mask, labels=ids[:, 1:]).mean().backward()
        optimizer.step()

    return model, optimizer, step


def _published(save_dir: str, iteration: int) -> bool:
    path = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    return os.path.isfile(path) and open(path).read().strip() == str(iteration)


def _train_until(step: Any, args: argparse.Namespace, iteration: int, steps: int, until_published: bool,
                 step_s: list[float]) -> tuple[float, float]:
    """Train `steps` steps, or (`until_published`) until the save of `iteration` is published, calling the
    non-blocking finalize after each step as the training loop does; returns (seconds spent in the finalize calls
    and in the steps' waits for the background copy, seconds from the start until published)."""
    from megatron.compat import maybe_finalize_async_save
    from megatron.core import saved_state

    start, spent, done = time.perf_counter(), 0.0, 0
    waited = saved_state.waited_seconds()
    while (not _published(args.save, iteration)) if until_published else done < steps:
        t1 = time.perf_counter()
        step()
        step_s.append(time.perf_counter() - t1)
        t1 = time.perf_counter()
        maybe_finalize_async_save(blocking=False)
        spent += time.perf_counter() - t1
        done += 1
    return spent + saved_state.waited_seconds() - waited, time.perf_counter() - start


def run(saves: int, steps_between: int, fmt: str, root: str) -> dict:
    """Alternate sync and async saves of one model; returns the blocked seconds per save of each mode."""
    from megatron.compat import save_checkpoint

    base = _args(os.path.join(root, "sync"), fmt)
    modes = {"sync": base, "async": copy.copy(base)}
    modes["async"].save = os.path.join(root, "async")
    modes["async"].async_save, modes["async"].use_persistent_ckpt_worker = True, True
    model, optimizer, step = _trainer(base)
    params = sum(p.numel() for p in model.parameters())
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    step_s: dict[str, list[float]] = {"sync": [], "async": []}  # sync: no write in flight; async: one in flight
    latency: list[float] = []
    step()
    for i in range(1, saves + 1):
        for mode in (("sync", "async") if i % 2 else ("async", "sync")):
            args = modes[mode]
            t0 = time.perf_counter()
            save_checkpoint(i, [model], optimizer, None, args)
            call = time.perf_counter() - t0
            finalize, until = _train_until(step, args, i, steps_between, mode == "async", step_s[mode])
            blocked[mode].append(call + finalize)
            if mode == "async":
                latency.append(call + until)
            shutil.rmtree(os.path.join(args.save, f"iter_{i:07d}"), ignore_errors=True)
    result = {"params": params, "format": fmt, "blocked_s": blocked, "publish_latency_s": latency, "step_s": step_s}
    for mode in ("sync", "async"):
        result[f"{mode}_mean_s"] = statistics.mean(blocked[mode][1:] or blocked[mode])
        result[f"{mode}_step_mean_s"] = statistics.mean(step_s[mode])
    result["ratio"] = result["async_mean_s"] / result["sync_mean_s"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=4, help="saves per mode (the first is a warm-up)")
    p.add_argument("--steps-between", type=int, default=3, help="training steps after each synchronous save")
    p.add_argument("--format", choices=["torch", "torch_dist"], default="torch")
    p.add_argument("--save-dir", default=None, help="where to write (default: a temporary folder, removed after)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", default=None, help="also write the results here")
    opts = p.parse_args()
    import torch

    if opts.threads:
        torch.set_num_threads(opts.threads)
    root = opts.save_dir or tempfile.mkdtemp(prefix="bench_async_save_")
    try:
        result = run(opts.saves, opts.steps_between, opts.format, root)
    finally:
        if opts.save_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"GPT {result['params'] / 1e6:.1f}M params, --ckpt-format {opts.format}, {torch.get_num_threads()} threads")
    for mode in ("sync", "async"):
        runs = ", ".join(f"{t:.2f}" for t in result["blocked_s"][mode])
        print(f"  {mode:5s}: blocked {result[f'{mode}_mean_s']:.2f} s per save (each: {runs}); a training step "
              f"{result[f'{mode}_step_mean_s']:.2f} s (mean; async: while the write is in flight)")
    print(f"  async / sync = {result['ratio']:.3f}; async save published "
          f"{statistics.mean(result['publish_latency_s']):.2f} s after the save call (mean)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
