"""The GPU benchmark of tools/gpu_check.sh: one JSON + text report.

Sections (each skipped with a reason where it cannot run, e.g. without CUDA):
  device       GPU name, memory, torch / Triton / transformers versions
  matmul_peak  measured bf16 matmul rate (n x n x n, median of 10, CUDA events): the MFU denominator
  megatron     GPT 1.3B preset (24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304), bf16 with fp32 main
               params (Megatron's mixed-precision optimizer), no dropout (SDPA's flash kernel), the largest micro
               batch that fits, 20 timed steps: step time, tokens/s, MFU (Megatron's FLOPs formula)
  hf           the same model as Hugging Face GPT2LMHeadModel (SDPA, fp32 weights under bf16 autocast, fused AdamW),
               same micro batch: step time and our/HF tokens/s ratio
  profile      torch.profiler table of the top CUDA kernels over 2 of our steps
  generation   our KV-cache generate() vs HF generate(), greedy, 128 prompt + 128 new tokens, batch 1 and 16: tokens/s
  kernels      each Triton kernel vs the pure-PyTorch path (MEGATRON_NO_TRITON=1), forward + backward, median ms
--quick: 4 layers of the 1.3B model, 5 steps, micro batch search from 8, no generation.
--smoke: every section on the CPU with a tiny model (2 layers, hidden 64, seq 64): proves the script runs (CI).

    python tools/benchmarks/bench_gpu.py --out DIR [--quick | --smoke]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron.presets import get_preset  # noqa: E402

_GPT = get_preset("gpt_1.3b")  # megatron/presets.py
LAYERS, HIDDEN, HEADS, SEQ = (int(_GPT.value(f)) for f in ("--num-layers", "--hidden-size", "--num-attention-heads",
                                                           "--seq-length"))
VOCAB = 50304
DEV = "cuda"
SMOKE = dict(LAYERS=2, HIDDEN=64, HEADS=4, SEQ=64, VOCAB=512, DEV="cpu")


def _cuda_ms(fn: Callable[[], Any], reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if DEV == "cpu":
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def device_info() -> dict:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    for name in ("triton", "transformers", "deepspeed"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - optional packages
            info[name] = f"missing ({type(exc).__name__})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}")
    return info


def matmul_peak(quick: bool) -> dict:
    n = 256 if DEV == "cpu" else 4096 if quick else 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    ms = statistics.median(_cuda_ms(lambda: a @ b, 10, 3))
    return {"n": n, "tflops": 2 * n**3 / ms / 1e9}


def _config(layers: int):
    from megatron.core.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             max_position_embeddings=SEQ, padded_vocab_size=VOCAB, hidden_dropout=0.0,
                             attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)


def _megatron_step(config, mbs: int):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.layers.module import Float16Module
    from megatron.models.gpt.model import GPTModel
    from megatron.optimizer import get_megatron_optimizer
    from megatron.optimizer.optimizer_config import OptimizerConfig
    from tools.benchmarks.bench_common import gpt_forward_step

    model_parallel_manual_seed(1234, 0)
    state = ps.ParallelState.single()
    model = Float16Module(GPTModel(config, parallel_output=True).to(DEV), config)
    optimizer = get_megatron_optimizer([model], OptimizerConfig(lr=1e-4, bf16=True, params_dtype=torch.bfloat16),
                                       state)
    forward = gpt_forward_step(SEQ, mbs)
    cuda_forward = _on_cuda(forward)
    batch = torch.randint(0, VOCAB, (mbs, SEQ + 1), device=DEV)

    def step() -> float:
        optimizer.zero_grad()
        store = forward_backward_no_pipelining(cuda_forward, iter([batch]), [model], 1,
                                               grad_scale_func=optimizer.scale_loss)
        optimizer.step()
        return float(store[0]["lm loss"])

    return model, optimizer, step


def _on_cuda(forward_step: Callable) -> Callable:
    """bench_common's forward step with its position ids and mask moved to CUDA."""
    cells = {c.cell_contents for c in (forward_step.__closure__ or ()) if isinstance(c.cell_contents, torch.Tensor)}
    moved = {id(t): t.to(DEV) for t in cells}
    for c in forward_step.__closure__ or ():
        if isinstance(c.cell_contents, torch.Tensor):
            c.cell_contents = moved[id(c.cell_contents)]
    return forward_step


def _free() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def _max_memory_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else None


def megatron_bench(quick: bool, steps: int, peak_tflops: float | None) -> dict:
    from megatron.flops import num_floating_point_operations

    config = _config(min(4, LAYERS) if quick else LAYERS)
    tried = {}
    for mbs in ((2, 1) if DEV == "cpu" else (8, 4, 2, 1) if quick else (16, 12, 8, 4, 2, 1)):
        try:
            model, _optimizer, step = _megatron_step(config, mbs)
            step()
            break
        except torch.cuda.OutOfMemoryError:
            tried[mbs] = "out of memory"
            model = _optimizer = step = None
            _free()
    else:
        return {"skipped": f"no micro batch fits ({tried})"}
    losses = []
    times = _cuda_ms(lambda: losses.append(step()), steps, warmup=2)
    step_s = statistics.median(times) / 1e3
    flops = num_floating_point_operations(config, mbs, SEQ)
    out = {"layers": config.num_layers, "micro_batch": mbs, "oom_at": sorted(tried), "steps": steps,
           "step_s": step_s, "tokens_per_s": mbs * SEQ / step_s, "model_tflops": flops / step_s / 1e12,
           "max_memory_gib": _max_memory_gib(), "loss_first": losses[0],
           "loss_last": losses[-1], "params": sum(p.numel() for p in model.parameters())}
    if peak_tflops:
        out["mfu"] = out["model_tflops"] / peak_tflops
    out["_step"] = step
    return out


def profile_table(step: Callable[[], float]) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        if DEV == "cuda":
            torch.cuda.synchronize()
    sort = "cuda_time_total" if DEV == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=20)


def hf_bench(quick: bool, steps: int, mbs: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=min(4, LAYERS) if quick else LAYERS,
                     n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").to(DEV).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=DEV == "cuda")
    batch = torch.randint(0, VOCAB, (mbs, SEQ), device=DEV)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    try:
        times = _cuda_ms(step, steps, warmup=2)
    except torch.cuda.OutOfMemoryError:
        return {"skipped": f"HF does not fit micro batch {mbs}"}
    step_s = statistics.median(times) / 1e3
    return {"micro_batch": mbs, "step_s": step_s, "tokens_per_s": mbs * SEQ / step_s,
            "max_memory_gib": _max_memory_gib()}


def generation_bench(quick: bool) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron.models.gpt.hf_gpt2 import hf_gpt2_config_kwargs, megatron_gpt_to_hf_state_dict
    from megatron.models.gpt.model import GPTModel
    from megatron.text_generation import generate

    config = _config(min(4, LAYERS) if quick else LAYERS)
    ours = GPTModel(config, parallel_output=False).to(DEV).eval()
    hf = GPT2LMHeadModel(GPT2Config(**hf_gpt2_config_kwargs(config))).to(torch.bfloat16).to(DEV).eval()
    hf.load_state_dict(megatron_gpt_to_hf_state_dict(ours.state_dict_for_save_checkpoint(), config), strict=False)
    out = {}
    new = 8 if DEV == "cpu" else 128
    for batch in (1, 16):
        prompts = torch.randint(0, VOCAB - 1, (batch, min(128, SEQ // 2))).tolist()

        def run_ours(prompts: list = prompts) -> None:
            with torch.no_grad():
                generate(ours, None, prompts, new, greedy=True, eod_id=VOCAB - 1,
                         use_eod_token_for_early_termination=False)

        def run_hf(prompts: list = prompts) -> None:
            ids = torch.tensor(prompts, device=DEV)
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)

        ours_s = statistics.median(_cuda_ms(run_ours, 3, 1)) / 1e3
        hf_s = statistics.median(_cuda_ms(run_hf, 3, 1)) / 1e3
        out[f"batch_{batch}"] = {"ours_tokens_per_s": batch * new / ours_s, "hf_tokens_per_s": batch * new / hf_s,
                                 "ratio": hf_s / ours_s}
    return out


def kernel_bench() -> dict:
    from megatron import fused_kernels
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron.layers.enums import AttnMaskType
    from megatron.layers.fused_layer_norm import MixedFusedLayerNorm
    from megatron.layers.fused_softmax import FusedScaleMaskSoftmax
    from megatron.layers.mlp import swiglu
    from megatron.layers.norms import RMSNorm
    from megatron.layers.rotary import RotaryEmbedding, apply_rotary_pos_emb
    from megatron.layers.utils import attention_mask_func, gelu_impl

    bf16 = dict(device=DEV, dtype=torch.bfloat16)
    small = DEV == "cpu"
    rows = 64 if small else 8 * 2048
    s, h, f, v = (32, 64, 96, VOCAB) if small else (2048, 2048, 5632, VOCAB)
    causal = FusedScaleMaskSoftmax(False, True, AttnMaskType.causal, True, attention_mask_func, True, None)
    cos, sin = RotaryEmbedding(128).cos_sin(s, 0, torch.device(DEV), torch.bfloat16)
    cases = {
        f"causal softmax [4,16,{s},{s}]": (lambda x: causal(x, None), [torch.randn(4, 16, s, s, **bf16)]),
        f"bias-gelu [{rows}, {4 * h}]": (lambda x, b: fused_kernels.bias_activation("gelu", x, b)
                                         if fused_kernels.runs_on(x) else gelu_impl(x + b),
                                         [torch.randn(rows, 4 * h, **bf16), torch.randn(4 * h, **bf16)]),
        f"bias-swiglu [{rows}, 2x{f}]": (lambda x, b: fused_kernels.bias_activation("swiglu", x, b)
                                         if fused_kernels.runs_on(x) else swiglu(x + b),
                                         [torch.randn(rows, 2 * f, **bf16), torch.randn(2 * f, **bf16)]),
        f"rmsnorm [{rows}, {h}]": (RMSNorm(h, params_dtype=torch.bfloat16).to(DEV), [torch.randn(rows, h, **bf16)]),
        f"layernorm [{rows}, {h}]": (MixedFusedLayerNorm(h, params_dtype=torch.bfloat16).to(DEV),
                                     [torch.randn(rows, h, **bf16)]),
        f"rope [{s},8,16,128]": (lambda t: apply_rotary_pos_emb(t, cos, sin), [torch.randn(s, 8, 16, 128, **bf16)]),
        f"cross entropy [{rows}, {v}] fp32": (
            lambda x: vocab_parallel_cross_entropy(x, torch.randint(0, v, (rows,), device=DEV)),
            [torch.randn(rows, v, device=DEV)]),
    }
    out = {}
    for name, (fn, inputs) in cases.items():
        timings = {}
        for label, disabled in (("triton_ms", "0"), ("torch_ms", "1")):
            os.environ[fused_kernels.DISABLE_ENV] = disabled
            leaves = [t.detach().requires_grad_() for t in inputs]

            def fwd_bwd(fn: Callable = fn, leaves: list = leaves) -> None:
                y = fn(*leaves)
                y.backward(torch.ones_like(y))

            timings[label] = statistics.median(_cuda_ms(fwd_bwd, 10, 3))
        os.environ.pop(fused_kernels.DISABLE_ENV, None)
        timings["speedup"] = timings["torch_ms"] / timings["triton_ms"]
        timings["triton_active"] = fused_kernels.runs_on(inputs[0])  # False: both timings are the torch path
        out[name] = timings
        _free()
    return out


def _section(report: dict, name: str, fn: Callable[[], Any]) -> Any:
    if DEV == "cuda" and not torch.cuda.is_available():
        report[name] = {"skipped": "no CUDA (dry run)"}
        return None
    t = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as exc:  # noqa: BLE001 - one section's failure is reported, the others still run
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    if isinstance(report[name], dict):
        report[name]["section_s"] = round(time.perf_counter() - t, 1)
    print(f"[bench_gpu] {name}: {json.dumps(report[name], default=str)[:600]}", flush=True)
    return report[name]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for bench_gpu.json, bench_gpu.txt and profile.txt")
    p.add_argument("--quick", action="store_true", help="4 layers, 5 steps, no generation")
    p.add_argument("--smoke", action="store_true", help="every section on the CPU with a tiny model (CI)")
    a = p.parse_args(argv)
    if a.smoke:
        globals().update(SMOKE)
    os.makedirs(a.out, exist_ok=True)
    steps = 2 if a.smoke else 5 if a.quick else 20
    report: dict[str, Any] = {"quick": a.quick, "smoke": a.smoke, "device": device_info()}
    print(f"[bench_gpu] device: {report['device']}", flush=True)
    peak = _section(report, "matmul_peak", lambda: matmul_peak(a.quick))
    peak_tflops = peak.get("tflops") if isinstance(peak, dict) else None
    ours = _section(report, "megatron", lambda: megatron_bench(a.quick, steps, peak_tflops))
    step = ours.pop("_step", None) if isinstance(ours, dict) else None
    if step is not None:
        _section(report, "profile", lambda: {"table": profile_table(step)})
    else:
        report["profile"] = {"skipped": report["megatron"].get("skipped", "our step did not run")}
    step = None
    _free()
    mbs = ours.get("micro_batch") if isinstance(ours, dict) else None
    if mbs:
        hf = _section(report, "hf", lambda: hf_bench(a.quick, steps, mbs))
        if isinstance(hf, dict) and "tokens_per_s" in hf:
            report["hf"]["ours_over_hf"] = ours["tokens_per_s"] / hf["tokens_per_s"]
    else:
        report["hf"] = {"skipped": report["megatron"].get("skipped", "our step did not run")}
    _free()
    if a.quick:
        report["generation"] = {"skipped": "--quick"}
    else:
        _section(report, "generation", lambda: generation_bench(a.quick))
    _free()
    _section(report, "kernels", kernel_bench)
    table = report.get("profile", {}).pop("table", None) if isinstance(report.get("profile"), dict) else None
    if table:
        with open(os.path.join(a.out, "profile.txt"), "w") as f:
            f.write(table)
        report["profile"]["file"] = "profile.txt"
    with open(os.path.join(a.out, "bench_gpu.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(a.out, "bench_gpu.txt"), "w") as f:
        f.write(format_report(report))
    print(format_report(report), flush=True)
    return report


def format_report(report: dict) -> str:
    lines = [f"device: {report['device']}"]
    for name in ("matmul_peak", "megatron", "hf", "profile", "generation", "kernels"):
        section = report.get(name, {})
        if "skipped" in section or "error" in section:
            lines.append(f"{name}: {section.get('skipped') or section.get('error')}")
        elif name == "kernels":
            lines += [f"kernel {k}: triton {v['triton_ms']:.3f} ms, torch {v['torch_ms']:.3f} ms, {v['speedup']:.2f}x"
                      + ("" if v["triton_active"] else " (Triton not active here: both are the torch path)")
                      for k, v in section.items() if isinstance(v, dict)]
        else:
            lines.append(f"{name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                 for k, v in section.items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
