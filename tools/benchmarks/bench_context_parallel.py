"""Context-parallel benchmark: per-rank activation memory of a long sequence at CP1/CP2/CP4, and ring attention's
cost against one process computing the same attention.

Model (tiny width, long sequence): GPT with RoPE, 2 layers, hidden 64, 4 heads, vocab 512, seq 8192, micro-batch 1,
fp32, no dropout, no recompute; one forward + backward per step. Every CP size runs in fresh gloo processes (one per
CP rank, one thread each) with glibc's mmap threshold pinned at 64 KiB so RSS follows what is allocated. Per rank:

* ``saved``: bytes of the tensors autograd keeps for backward at the end of the forward pass (saved_tensors_hooks,
  each storage once, parameters excluded): the activation memory;
* ``peak``: peak RSS of the step minus the RSS before it (VmHWM after /proc/self/clear_refs): activations plus the
  forward/backward temporaries;
* the step's wall time and CPU time.

Attention alone (``--attention``): q/k/v [s/N, 1, 4, 16] per rank, causal; one process runs torch SDPA (its CPU
flash kernel) over the whole sequence; N ranks run the p2p ring with the transfers overlapped with computation
(the default) and with each transfer awaited before computing (``OVERLAP = False``). Reported: wall time (the
slowest rank) and CPU time summed over ranks. With 2 cores, N = 4 ranks share cores: compare CPU time there.

    python tools/benchmarks/bench_context_parallel.py [--seq 8192] [--sizes 1,2,4] [--steps 2] [--attention]
                                                      [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

MB = 1024.0 * 1024.0
LAYERS, HIDDEN, HEADS, VOCAB = 2, 64, 4, 512


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model_rank(seq: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.context_parallel import slice_for_cp
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.core.transformer_config import TransformerConfig
    from megatron.models.gpt.model import GPTModel

    n = dist.get_world_size()
    state = ps.initialize_model_parallel(context_parallel_size=n)
    torch.manual_seed(1234)
    model_parallel_manual_seed(1234, 0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               max_position_embeddings=seq, padded_vocab_size=VOCAB, hidden_dropout=0.0,
                               attention_dropout=0.0, position_embedding_type="rope", context_parallel_size=n)
    model = GPTModel(config, tp_group=None, pp_state=state, parallel_output=True)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict = {"on": False, "storages": {}}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if saved["on"]:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                saved["storages"][ptr] = t.untyped_storage().nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    positions = slice_for_cp(torch.arange(seq).unsqueeze(0), 1, n, state.cp_rank)

    def step() -> None:
        data = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
        tokens, labels = (slice_for_cp(t, 1, n, state.cp_rank) for t in (data[:, :-1], data[:, 1:]))
        model.zero_grad(set_to_none=False)
        saved["on"], saved["storages"] = True, {}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            losses = model(tokens.contiguous(), positions, None, labels=labels.contiguous())
        saved["on"] = False
        (losses.float().sum() / seq).backward()

    step()  # warm-up: gradient buffers, RoPE tables
    gc.collect()
    best: dict = {}
    for _ in range(steps):
        gc.collect()
        base = _status_kib("VmRSS")
        _reset_peak()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        peak = (_status_kib("VmHWM") - base) / 1024.0
        if not best or wall < best["wall_s"]:
            best = {"saved_mb": sum(saved["storages"].values()) / MB, "peak_mb": peak, "wall_s": wall, "cpu_s": cpu}
    return best


def _attention_rank(seq: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron.core import context_parallel as cpa

    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(seq, 1, HEADS, HIDDEN // HEADS, generator=g) for _ in range(3)]
    out: dict = {}

    def timed(fn) -> tuple[float, float]:
        fn()
        best = (float("inf"), 0.0)
        for _ in range(steps):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            dist.barrier()
            best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
        return best

    if n == 1:
        q, k, v = (t.permute(1, 2, 0, 3).clone().requires_grad_() for t in full)

        def sdpa() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        out["sdpa"] = timed(sdpa)
        return out
    q, k, v = (cpa.slice_for_cp(t, 0, n, r).clone().requires_grad_() for t in full)

    def ring() -> None:
        cpa.context_parallel_attention(q, k, v, dist.group.WORLD, comm_type="p2p", causal=True).sum().backward()

    out["ring"] = timed(ring)
    cpa.OVERLAP = False
    out["ring_no_overlap"] = timed(ring)
    cpa.OVERLAP = True
    return out


def _worker(rank: int, world: int, port: int, what: str, seq: int, steps: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = (_model_rank if what == "model" else _attention_rank)(seq, steps)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run(what: str, world: int, seq: int, steps: int) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, port, what, seq, steps, out_dir), nprocs=world, join=True,
                           start_method="spawn")
        return [json.load(open(os.path.join(out_dir, f"{r}.json"))) for r in range(world)]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--sizes", type=str, default="1,2,4")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--attention", action="store_true", help="also time attention alone (SDPA vs the ring)")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks: freed tensors leave the RSS
    sizes = [int(x) for x in args.sizes.split(",")]
    results: dict = {"seq": args.seq, "model": {}, "attention": {}}
    print(f"GPT {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, seq {args.seq}, fp32, no recompute; per rank (max):")
    print("| CP | saved activations (MB) | x CP1 | peak - baseline (MB) | x CP1 | step wall (s) | step CPU, all ranks (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in sizes:
        ranks = run("model", n, args.seq, args.steps)
        row = {k: max(r[k] for r in ranks) for k in ("saved_mb", "peak_mb", "wall_s")}
        row["cpu_s"] = sum(r["cpu_s"] for r in ranks)
        results["model"][n] = row
        one = results["model"].get(1, row)
        print(f"| {n} | {row['saved_mb']:.1f} | {row['saved_mb'] / one['saved_mb']:.3f} | {row['peak_mb']:.1f} | "
              f"{row['peak_mb'] / one['peak_mb']:.3f} | {row['wall_s']:.2f} | {row['cpu_s']:.2f} |")
    if args.attention:
        print("attention alone (causal, fwd + bwd): wall (slowest rank) / CPU summed over ranks, seconds")
        for n in sizes:
            ranks = run("attention", n, args.seq, args.steps)
            for name in ranks[0]:
                wall, cpu = max(r[name][0] for r in ranks), sum(r[name][1] for r in ranks)
                results["attention"][f"{name}@{n}"] = {"wall_s": wall, "cpu_s": cpu}
                print(f"  N={n} {name}: wall {wall:.2f} s, CPU {cpu:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
