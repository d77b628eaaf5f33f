"""Shared helpers of the training-step benchmarks (bench_train_*.py): the measured fp32 matmul peak that MFU is
computed against, the common command-line flags, a Megatron fp32 training step (Megatron optimizer + the
no-pipelining schedule, one process) and the interleaved timing loop (each step of every contender in turn,
alternating the order, so that all of them see the same machine load)."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Iterable

import torch


def matmul_peak_flops(n: int = 2048, reps: int = 10) -> float:
    """Best observed fp32 GEMM FLOP/s on this machine (n x n x n)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def add_common_args(p: argparse.ArgumentParser, steps: int = 5, warmup: int = 2) -> None:
    """--steps, --warmup, --threads, --json."""
    p.add_argument("--steps", type=int, default=steps, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed warm-up steps per contender")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--json", type=str, default=None, help="also write the results here")


def megatron_train_step(model: torch.nn.Module, forward_step: Callable, clip_grad: float = 1.0,
                        loss_key: str = "lm loss") -> Callable[[Any], float]:
    """One fp32 training step of `model` (single process): Megatron's optimizer (AdamW lr 1e-4, wd 0.01, clipping)
    around forward_backward_no_pipelining with `forward_step(data_iterator, model)`; returns the step function."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.optimizer import get_megatron_optimizer
    from megatron.optimizer.optimizer_config import OptimizerConfig

    state = ps.ParallelState.single()
    optimizer = get_megatron_optimizer([model], OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=clip_grad),
                                       state)

    def step(batch: Any) -> float:
        optimizer.zero_grad()
        store = forward_backward_no_pipelining(forward_step, iter([batch]), [model], 1,
                                               grad_scale_func=optimizer.scale_loss)
        optimizer.step()
        return float(store[0][loss_key])

    return step


def hf_train_step(model: torch.nn.Module, clip_grad: float = 1.0) -> Callable[[torch.Tensor], float]:
    """One fp32 training step of a Hugging Face causal LM in a plain loop: torch.optim.AdamW (lr 1e-4, wd 0.01),
    gradient clipping, batches [mbs, seq + 1] of token ids (HF shifts the labels itself); returns the step function."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(batch: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        opt.step()
        return float(out.loss.detach())

    return step


def run_interleaved(steps: dict[str, Callable[[Any], float]], batches: dict[str, Iterable[Any]] | Iterable[Any],
                    warmup: int) -> dict[str, dict[str, Any]]:
    """Run the contenders' steps interleaved (batch i of each, alternating which goes first); per contender the
    median wall and process-CPU seconds of the steps after `warmup`, and the losses. `batches` is one list for all
    or one list per contender (the same length)."""
    per = batches if isinstance(batches, dict) else {name: batches for name in steps}
    per = {name: list(b) for name, b in per.items()}
    n = len(next(iter(per.values())))
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(n):
        for name in (names if i % 2 == 0 else list(reversed(names))):
            t, c = time.perf_counter(), time.process_time()
            losses[name].append(steps[name](per[name][i]))
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
    return {name: {"step_s": statistics.median(times[name]), "cpu_s": statistics.median(cpu[name]),
                   "times": times[name], "cpu_times": cpu[name], "losses": losses[name]} for name in steps}


def gpt_forward_step(seq: int, mbs: int) -> Callable:
    """Megatron's GPT forward step for `megatron_train_step`: batches [mbs, seq + 1] of token ids, shifted into
    tokens and labels, the causal mask, the mean LM loss."""
    position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu_(1)

    def forward_step(data_iterator, m):
        data = next(data_iterator)
        tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        losses = m(tokens, position_ids, mask, labels=labels)

        def loss_func(out):
            loss = out.float().mean()
            return loss, {"lm loss": loss.detach()}

        return losses, loss_func

    return forward_step
