"""Per-rank optimizer-state memory with and without the distributed optimizer (--use-distributed-optimizer).

GPT 12 layers / hidden 768 / 12 heads / seq 1024 / vocab 50304 (GPT-2 small) at data-parallel sizes 1, 2 and 4
(gloo processes on CPU), fp32 params or bf16 params (fp32 gradient accumulation), local DDP, Adam. Each
configuration runs one training step (micro-batch 1 of ``--step-tokens`` tokens, default 1024, so that Adam's state
exists; the state does not depend on it, and bf16 matmuls are slow on most CPUs), then every rank measures the
tensors its optimizer actually holds:

* ``main params``: the fp32 params the inner torch optimizer updates (for fp32 training without the distributed
  optimizer these are the model params themselves; with it, views of this rank's shard; with bf16, fp32 copies);
* ``Adam state``: exp_avg + exp_avg_sq (the step counters are not counted).

Bytes are the sums of ``numel * element_size`` over those tensors (each storage range once), the maximum over the
ranks is reported, with the ratio to DP=1 of the same precision and optimizer. Expected: constant without the
distributed optimizer, ~1/DP with it.

    python tools/benchmarks/bench_optimizer_memory.py [--dp 1,2,4] [--params fp32,bf16] [--step-tokens 1024]
                                                      [--markdown] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 12, 768, 12, 1024, 50304
MB = 1024.0 * 1024.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_optimizer_bytes(optimizer: Any) -> dict[str, int]:
    """Bytes of the fp32 main params and of the tensor optimizer state the inner torch optimizer holds."""
    import torch

    inner = optimizer.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    main = sum(p.numel() * p.element_size() for p in params)
    state = 0
    for p in params:
        for key, value in inner.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and key != "step":
                state += value.numel() * value.element_size()
    return {"main_bytes": main, "state_bytes": state, "main_numel": sum(p.numel() for p in params)}


def _worker(rank: int, world_size: int, port: int, dtype_name: str, distopt: bool, seq: int, out_dir: str,
            threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.tensor_parallel import model_parallel_manual_seed
        from megatron.core.transformer_config import TransformerConfig
        from megatron.layers.module import Float16Module
        from megatron.models.gpt.model import GPTModel
        from megatron.optimizer import get_megatron_optimizer
        from megatron.optimizer.optimizer_config import OptimizerConfig

        state = ps.initialize_model_parallel()
        torch.manual_seed(1234)
        model_parallel_manual_seed(1234, 0)
        bf16 = dtype_name == "bf16"
        config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                   max_position_embeddings=SEQ, padded_vocab_size=VOCAB, hidden_dropout=0.0,
                                   attention_dropout=0.0)
        model: torch.nn.Module = GPTModel(config, tp_group=None, pp_state=state, parallel_output=True)
        n_params = sum(p.numel() for p in model.parameters())
        if bf16:
            model = Float16Module(model, torch.bfloat16)
        model = DistributedDataParallel(model, dp_group=state.dp_group, accumulate_allreduce_grads_in_fp32=True,
                                        use_distributed_optimizer=distopt)
        opt_config = OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=1.0, bf16=bf16,
                                     params_dtype=torch.bfloat16 if bf16 else torch.float32,
                                     use_distributed_optimizer=distopt)
        optimizer = get_megatron_optimizer([model], opt_config, state)
        g = torch.Generator().manual_seed(rank)
        data = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
        position_ids = torch.arange(seq).unsqueeze(0)
        mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu_(1)
        t = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(data[:, :-1], position_ids, mask, labels=data[:, 1:]).float().mean()
        optimizer.scale_loss(loss).backward()
        finalize_model_grads([model], state)
        ok, _, _ = optimizer.step()
        step_s = time.perf_counter() - t
        measured = measure_optimizer_bytes(optimizer)
        result = {"ok": bool(ok), "step_s": step_s, "n_params": n_params, **measured}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_config(dp: int, dtype_name: str, distopt: bool, seq: int, threads: int) -> dict[str, Any]:
    """Spawn `dp` gloo processes for one configuration; returns the per-rank maxima."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(dp, _free_port(), dtype_name, distopt, seq, out_dir, threads), nprocs=dp,
                           join=True, start_method="spawn")
        ranks = []
        for rank in range(dp):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    return {
        "dp": dp, "params": dtype_name, "distopt": distopt, "n_params": ranks[0]["n_params"],
        "main_mb": max(r["main_bytes"] for r in ranks) / MB, "state_mb": max(r["state_bytes"] for r in ranks) / MB,
        "total_mb": max(r["main_bytes"] + r["state_bytes"] for r in ranks) / MB,
        "step_s": max(r["step_s"] for r in ranks), "all_ok": all(r["ok"] for r in ranks),
    }


def format_table(results: list[dict[str, Any]], markdown: bool) -> str:
    base = {(r["params"], r["distopt"]): r["total_mb"] for r in results if r["dp"] == 1}
    header = ["params", "distributed optimizer", "DP", "fp32 main params (MB/rank)", "Adam state (MB/rank)",
              "total (MB/rank)", "vs DP=1", "bytes/param"]
    rows = []
    for r in results:
        ref = base.get((r["params"], r["distopt"]))
        rows.append([r["params"], "yes" if r["distopt"] else "no", str(r["dp"]), f"{r['main_mb']:.1f}",
                     f"{r['state_mb']:.1f}", f"{r['total_mb']:.1f}", f"{r['total_mb'] / ref:.3f}" if ref else "-",
                     f"{r['total_mb'] * MB / r['n_params']:.2f}"])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dp", type=str, default="1,2,4", help="comma-separated data-parallel sizes")
    p.add_argument("--params", type=str, default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--step-tokens", type=int, default=SEQ, help="tokens of the one training step (<= 1024)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    a = p.parse_args(argv)
    if not 1 <= a.step_tokens <= SEQ:
        p.error(f"--step-tokens must be between 1 and {SEQ} (got {a.step_tokens})")
    try:
        dps = [int(x) for x in a.dp.split(",")]
    except ValueError:
        p.error(f"--dp takes comma-separated integers (got {a.dp!r})")
    dtypes = a.params.split(",")
    if any(d not in ("fp32", "bf16") for d in dtypes):
        p.error(f"--params: choose from fp32, bf16 (got {a.params!r})")
    results = []
    for dtype_name in dtypes:
        for distopt in (False, True):
            for dp in dps:
                t = time.perf_counter()
                try:
                    result = run_config(dp, dtype_name, distopt, a.step_tokens, a.threads)
                except Exception as exc:  # noqa: BLE001 - a worker killed by a loaded machine: retry once
                    print(f"  {dtype_name} distopt={distopt} DP={dp} failed ({exc}); retrying once", file=sys.stderr)
                    result = run_config(dp, dtype_name, distopt, a.step_tokens, a.threads)
                results.append(result)
                print(f"  {dtype_name} distopt={distopt} DP={dp}: {result['total_mb']:.1f} MB/rank "
                      f"({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    print(f"GPT {LAYERS} layers / hidden {HIDDEN} / {HEADS} heads / seq {SEQ} / vocab {VOCAB} "
          f"({results[0]['n_params'] / 1e6:.1f}M params), Adam, one step of {a.step_tokens} tokens on gloo CPU "
          "processes; per-rank maxima")
    print(format_table(results, a.markdown))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
