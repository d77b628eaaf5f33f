"""Benchmark of tools/checkpoint/convert.py: wall time and peak RSS of TP1 -> TP4 (Megatron), TP1 -> Hugging Face and
TP1 -> DeepSpeed -> TP1 for a GPT preset with fp32 random weights, printed with the model size and the largest input shard.

The source checkpoint is written by the converter's own saver from random layers generated one at a time (so making
it is itself bounded in memory). Each conversion runs as `python tools/checkpoint/convert.py ...` in a fresh process;
its peak RSS comes from os.wait4 (that process alone). The reference measured in the same run is a plain
``torch.load`` + ``torch.save`` of the input shard (the naive way to rewrite it: it holds the whole shard), and the
ratios are printed against it; the memory target is a peak RSS of at most about 1.5x the largest input shard.

    nice python tools/benchmarks/bench_convert.py [--preset 1.3b|350m|tiny] [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from megatron.presets import get_preset  # noqa: E402

_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")
PRESETS = {  # GPT-3-style shapes: layers, hidden, heads, sequence ("1.3b": megatron/presets.py's gpt_1.3b)
    "1.3b": tuple(int(get_preset("gpt_1.3b").value(flag)) for flag in _FLAGS),
    "350m": (24, 1024, 16, 2048),
    "tiny": (4, 256, 8, 512),
}
TRUE_VOCAB = 50257


def _random_stream(num_layers: int, hidden: int, seq: int) -> Iterator:
    import torch

    from megatron.checkpoint.conversion.interchange import EMBEDDINGS, FINAL_NORM, Message, layer_message

    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    yield Message(EMBEDDINGS, {"word_embeddings.weight": rnd(TRUE_VOCAB, hidden),
                               "position_embeddings.weight": rnd(seq, hidden)})
    for i in range(num_layers):
        yield Message(layer_message(i), {
            "input_layernorm.weight": torch.ones(hidden), "input_layernorm.bias": torch.zeros(hidden),
            "self_attention.query_key_value.weight": rnd(3 * hidden, hidden),
            "self_attention.query_key_value.bias": torch.zeros(3 * hidden),
            "self_attention.dense.weight": rnd(hidden, hidden), "self_attention.dense.bias": torch.zeros(hidden),
            "post_attention_layernorm.weight": torch.ones(hidden),
            "post_attention_layernorm.bias": torch.zeros(hidden),
            "mlp.dense_h_to_4h.weight": rnd(4 * hidden, hidden), "mlp.dense_h_to_4h.bias": torch.zeros(4 * hidden),
            "mlp.dense_4h_to_h.weight": rnd(hidden, 4 * hidden), "mlp.dense_4h_to_h.bias": torch.zeros(hidden)})
    yield Message(FINAL_NORM, {"final_layernorm.weight": torch.ones(hidden), "final_layernorm.bias": torch.zeros(hidden)})


def make_source(folder: str, preset: str) -> int:
    from megatron.checkpoint.conversion.interchange import ModelMeta
    from megatron.checkpoint.conversion.megatron_format import write_megatron

    layers, hidden, heads, seq = PRESETS[preset]
    arch = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
                kv_channels=hidden // heads, max_position_embeddings=seq, padded_vocab_size=TRUE_VOCAB)
    meta = ModelMeta("GPT", arch, true_vocab_size=TRUE_VOCAB, iteration=1)
    write_megatron(meta, _random_stream(layers, hidden, seq), folder, 1, 1)
    return layers * (12 * hidden * hidden + 13 * hidden) + (50304 + seq) * hidden + 2 * hidden


def _measure(cmd: List[str]) -> Tuple[float, float]:
    """(wall seconds, peak RSS GiB) of a command in a fresh process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
    if status != 0:
        raise SystemExit(f"command failed ({' '.join(cmd)}): {err}")
    return wall, usage.ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1.3b", choices=sorted(PRESETS))
    parser.add_argument("--workdir", default=None, help="Scratch folder (default: a temporary one under /tmp)")
    parser.add_argument("--keep", action="store_true", help="Keep the checkpoints")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    src = os.path.join(work, "src")
    shutil.rmtree(src, ignore_errors=True)
    t0 = time.perf_counter()
    params = make_source(src, args.preset)
    made = time.perf_counter() - t0
    shard = os.path.join(src, "iter_0000001", "mp_rank_00", "model_optim_rng.pt")
    shard_gib = os.path.getsize(shard) / 2**30
    print(f"GPT {args.preset}: {params / 1e9:.2f}B parameters, fp32; largest input shard {shard_gib:.2f} GiB "
          f"(source written in {made:.1f} s)", flush=True)
    py = sys.executable
    naive = [py, "-c", "import sys, torch; sd = torch.load(sys.argv[1], weights_only=False); "
             "torch.save(sd, sys.argv[2])", shard, os.path.join(work, "naive.pt")]
    runs: Dict[str, List[str]] = {
        "reference: torch.load + torch.save of the shard": naive,
        "TP1 -> TP4 (Megatron)": [py, "tools/checkpoint/convert.py", "--model-type", "GPT", "--load-dir", src,
                                  "--save-dir", os.path.join(work, "tp4"), "--target-tensor-parallel-size", "4"],
        "TP1 -> Hugging Face (safetensors)": [py, "tools/checkpoint/convert.py", "--model-type", "GPT", "--load-dir",
                                              src, "--saver", "hf", "--save-dir", os.path.join(work, "hf")],
        "TP1 -> DeepSpeed (mp_rank_00_model_states.pt)": [
            py, "tools/checkpoint/convert.py", "--model-type", "GPT", "--load-dir", src, "--saver", "deepspeed",
            "--save-dir", os.path.join(work, "ds")],
        "DeepSpeed -> TP1 (Megatron)": [py, "tools/checkpoint/convert.py", "--model-type", "GPT", "--loader",
                                        "deepspeed", "--load-dir", os.path.join(work, "ds"), "--save-dir",
                                        os.path.join(work, "from_ds")],
    }
    results = {}
    for name, cmd in runs.items():
        results[name] = _measure(cmd)
        wall, rss = results[name]
        print(f"  {name:48s} {wall:8.1f} s   peak RSS {rss:6.2f} GiB = {rss / shard_gib:.2f}x the input shard",
              flush=True)
    ref_wall = results[next(iter(runs))][0]
    for name in list(runs)[1:]:
        print(f"  {name}: {results[name][0] / ref_wall:.2f}x the reference's wall time", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
