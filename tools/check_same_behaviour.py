"""Behaviour-identity check for refactors: same log lines, same checkpoints, before and after a change.

Runs tiny trainings on CPU (one process each, fixed seeds, fp32): GPT, Llama-style GPT, BERT, T5 and GPT under
DeepSpeed ZeRO-1. Each run of 6 iterations (validation and a checkpoint every 2) stops at iteration 4
(--exit-interval), then a second run resumes from that checkpoint to the end. The record holds, per run:

- the log lines (stdout) with timings masked: per-iteration time, samples per second, TFLOPs, datetimes, timers,
  "... in N seconds" and the time-to-initialise line; paths under the work folder are written as ``<WORK>``;
- per checkpoint file: the sha256 of its bytes and a digest of its content (every tensor's dtype, shape and bytes;
  every other value as text, ``args`` as a sorted mapping). Volatile fields excluded from the content digest (and
  the byte check of the files holding them): none in our Megatron files (their bytes are compared); DeepSpeed's
  files are compared by content (``ds_version`` and the pickled engine objects of DeepSpeed's own bookkeeping are
  kept as text), ``manifest.json`` by its file names and sizes (its CRCs follow the bytes).

Usage::

    python tools/check_same_behaviour.py --record before.json     # on the commit before the change
    python tools/check_same_behaviour.py --compare before.json    # after: exit 1 and a diff when anything differs

``--only gpt,bert`` limits the runs; ``--workdir`` picks the scratch folder (a fixed path, so that the paths stored
in the checkpoints' ``args`` are the same in both runs; it is emptied first).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("MEGATRON_SHARED_DATA", "/work/shared/data")
DEFAULT_WORKDIR = os.path.join("/tmp", f"check_same_behaviour-{os.getuid()}")
NUM_DOCS = 40

# Log content that changes from run to run (wall-clock): masked, the rest of the line kept.
_MASKS = [
    (re.compile(r"(elapsed time per iteration \((?:ms|s)\): )[0-9.]+"), r"\1<T>"),
    (re.compile(r"(samples per second: |TFLOPs: )[0-9.]+"), r"\1<T>"),
    (re.compile(r"(datetime: ).*"), r"\1<T>"),
    (re.compile(r"(time to initialize megatron \(seconds\): )[0-9.]+"), r"\1<T>"),
    (re.compile(r"( in |time: )[0-9.]+( seconds)"), r"\1<T>\2"),
    (re.compile(r"(\(seconds\): )[0-9.]+"), r"\1<T>"),
    (re.compile(r"^(\s+[\w/-]+ \.+: )\([0-9., ]+\)$"), r"\1<T>"),  # timers: (min, max) ms over ranks
]
# Whole lines that are timings or memory figures only.
_DROP = re.compile(r"^\s*(\(min, max\) time across ranks|time \(ms\)|\[Rank \d+\] \(after|.*memory \(MB\))")


def _run_argv(kind: str, data: dict) -> tuple[str, list[str]]:
    common = ["--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3", "--min-lr", "1e-4",
              "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--weight-decay",
              "0.01", "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--save-interval", "2",
              "--num-workers", "0", "--seed", "1234", "--log-params-norm", "--log-num-zeros-in-grad"]
    gpt = ["--num-layers", "2", "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-file",
           data["gpt_vocab"], "--merge-file", data["gpt_merges"], "--data-path", data["gpt_prefix"],
           "--split", "90,10,0"]
    if kind == "gpt":
        return "pretrain_gpt.py", common + gpt
    if kind == "llama":
        return "pretrain_gpt.py", common + gpt + [
            "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
            "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--ffn-hidden-size", "48"]
    if kind == "gpt_deepspeed":
        return "pretrain_gpt.py", common + gpt + ["--deepspeed", "--deepspeed_config", data["ds_config"]]
    bert_data = ["--vocab-file", data["bert_vocab"], "--data-path", data["bert_prefix"], "--split", "90,10,0",
                 "--no-bias-gelu-fusion"]
    if kind == "bert":
        return "pretrain_bert.py", common + bert_data + ["--num-layers", "2", "--seq-length", "32",
                                                         "--max-position-embeddings", "32"]
    if kind == "t5":
        return "pretrain_t5.py", common + bert_data + [
            "--num-layers", "2", "--decoder-num-layers", "1", "--encoder-seq-length", "32",
            "--decoder-seq-length", "16", "--max-position-embeddings", "32", "--vocab-extra-ids", "100"]
    raise ValueError(f"unknown run {kind!r}")


RUNS = ("gpt", "llama", "bert", "t5", "gpt_deepspeed")


# ----------------------------------------------------------------------------------------------- data
def _prepare_data(work: str) -> dict:
    """A few OpenWebText documents as GPT (BPE, documents) and BERT/T5 (WordPiece, sentences) datasets."""
    sys.path.insert(0, ROOT)
    from megatron.data import preprocessing

    src = os.path.join(work, "owt.jsonl")
    with open(os.path.join(DATA, "openwebtext-1000", "openwebtext-1000.jsonl"), encoding="utf-8") as f:
        lines = [f.readline() for _ in range(NUM_DOCS)]
    with open(src, "w", encoding="utf-8") as f:
        f.write("".join(lines))
    owt = os.path.join(DATA, "openwebtext-1000")
    data = {"gpt_vocab": os.path.join(owt, "gpt2-tiny-vocab.json"),
            "gpt_merges": os.path.join(owt, "gpt2-tiny-merges.txt"),
            "bert_vocab": os.path.join(DATA, "bert-wordpiece", "bert-base-uncased-vocab.txt"),
            "gpt_prefix": os.path.join(work, "gpt_text_document"),
            "bert_prefix": os.path.join(work, "bert_text_sentence")}
    quiet = io.StringIO()
    stdout, sys.stdout = sys.stdout, quiet
    try:
        assert preprocessing.main(preprocessing.run, [
            "--input", src, "--output-prefix", os.path.join(work, "gpt"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", data["gpt_vocab"], "--merge-file", data["gpt_merges"], "--append-eod"]) == 0
        assert preprocessing.main(preprocessing.run, [
            "--input", src, "--output-prefix", os.path.join(work, "bert"), "--tokenizer-type",
            "BertWordPieceLowerCase", "--vocab-file", data["bert_vocab"], "--split-sentences"]) == 0
    finally:
        sys.stdout = stdout
    data["ds_config"] = os.path.join(work, "ds_config.json")
    with open(data["ds_config"], "w") as f:
        json.dump({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                   "zero_optimization": {"stage": 1}, "fp16": {"enabled": False}, "bf16": {"enabled": False}}, f)
    return data


# ----------------------------------------------------------------------------------------------- digests
def _normalise_line(line: str, work: str) -> Optional[str]:
    if _DROP.match(line):
        return None
    line = line.replace(work, "<WORK>")
    for pattern, repl in _MASKS:
        line = pattern.sub(repl, line)
    return line.rstrip()


def _value_digest(value: Any, work: str, out: dict, prefix: str) -> None:
    """Flatten `value` into `out`: tensors as dtype/shape/sha256, containers recursively, the rest as text."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[prefix] = f"tensor {t.dtype} {tuple(value.shape)} {hashlib.sha256(raw).hexdigest()[:16]}"
    elif isinstance(value, dict):
        if not value:
            out[prefix] = "{}"
        for key in sorted(value, key=str):
            _value_digest(value[key], work, out, f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
        for i, item in enumerate(value):
            _value_digest(item, work, out, f"{prefix}[{i}]")
    elif isinstance(value, argparse.Namespace):
        _value_digest(vars(value), work, out, prefix)
    elif hasattr(value, "__dict__") and not isinstance(value, type) and type(value).__module__ != "builtins":
        out[prefix] = f"<{type(value).__module__}.{type(value).__qualname__}>"
        _value_digest({k: v for k, v in vars(value).items() if not k.startswith("_")}, work, out, prefix)
    else:
        out[prefix] = repr(value).replace(work, "<WORK>")


def _file_digest(path: str, work: str) -> dict:
    import torch

    with open(path, "rb") as f:
        raw = f.read()
    rel = os.path.relpath(path, work)
    entry: dict[str, Any] = {"sha256": hashlib.sha256(raw).hexdigest()}
    deepspeed = "/global_step" in "/" + rel
    if deepspeed and os.path.basename(rel) == "manifest.json":  # DeepSpeed's bytes vary: names and sizes only
        files = json.loads(raw).get("files", {})
        entry = {"manifest": {name: files[name].get("size") for name in sorted(files)}}
    elif rel.endswith(".pt"):
        content: dict = {}
        _value_digest(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False), work, content, "")
        entry["content"] = content
        if deepspeed:  # DeepSpeed's files: content only (its pickles carry engine objects)
            del entry["sha256"]
    else:
        entry["text"] = raw.decode("utf-8", "replace").replace(work, "<WORK>")
    return entry


def _checkpoint_digest(save: str, work: str) -> dict:
    out = {}
    for folder, _, files in sorted(os.walk(save)):
        for name in sorted(files):
            path = os.path.join(folder, name)
            out[os.path.relpath(path, work)] = _file_digest(path, work)
    return out


# ----------------------------------------------------------------------------------------------- runs
def _train(kind: str, data: dict, work: str, load: Optional[str], save: str) -> list[str]:
    script, argv = _run_argv(kind, data)
    argv = argv + ["--save", save] + (["--load", load] if load else ["--exit-interval", "4"])
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONHASHSEED": "0",
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(int(os.environ.get("CHECK_SAME_BEHAVIOUR_PORT", "29700")) + RUNS.index(kind)), "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *argv], cwd=work, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{kind}: {script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = [_normalise_line(line, work) for line in proc.stdout.splitlines()]
    return [line for line in lines if line is not None]


def record(work: str, only: list[str]) -> dict:
    """Run every selected training twice (fresh, then resumed) and return the digests."""
    if os.path.isdir(work):
        shutil.rmtree(work)
    os.makedirs(work)
    data = _prepare_data(work)
    out: dict = {}
    for kind in only:
        save = os.path.join(work, f"ckpt_{kind}")
        first = _train(kind, data, work, None, save)
        resumed = _train(kind, data, work, save, save)
        out[kind] = {"log": first, "log_resumed": resumed, "checkpoints": _checkpoint_digest(save, work)}
        print(f"{kind}: {len(first)} + {len(resumed)} log lines, {len(out[kind]['checkpoints'])} checkpoint files",
              flush=True)
    return out


def compare(old: dict, new: dict) -> list[str]:
    """Human-readable differences (empty when identical)."""
    problems = []
    for kind in sorted(set(old) | set(new)):
        if kind not in old or kind not in new:
            problems.append(f"{kind}: only in {'the record' if kind in old else 'this run'}")
            continue
        for key in ("log", "log_resumed"):
            a, b = old[kind][key], new[kind][key]
            if a != b:
                import difflib

                diff = list(difflib.unified_diff(a, b, "recorded", "now", lineterm="", n=1))
                problems.append(f"{kind} {key}:\n" + "\n".join(diff[:40]))
        ca, cb = old[kind]["checkpoints"], new[kind]["checkpoints"]
        for name in sorted(set(ca) | set(cb)):
            if name not in ca or name not in cb:
                problems.append(f"{kind}: checkpoint file {name} only in {'the record' if name in ca else 'this run'}")
            elif ca[name] != cb[name]:
                fa, fb = ca[name], cb[name]
                detail = []
                for field in sorted(set(fa.get("content", {})) | set(fb.get("content", {}))):
                    va, vb = fa.get("content", {}).get(field), fb.get("content", {}).get(field)
                    if va != vb:
                        detail.append(f"    {field}: {va} -> {vb}")
                if not detail:
                    detail.append("    bytes differ (same content)" if "sha256" in fa else f"    {fa} -> {fb}")
                problems.append(f"{kind}: {name} differs:\n" + "\n".join(detail[:20]))
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--record", metavar="FILE", help="write the digests of this tree's runs to FILE")
    group.add_argument("--compare", metavar="FILE", help="run again and compare with FILE (exit 1 on a difference)")
    parser.add_argument("--only", default=",".join(RUNS), help=f"comma-separated runs out of {','.join(RUNS)}")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR, help="scratch folder (emptied first)")
    args = parser.parse_args(argv)
    only = [k for k in args.only.split(",") if k]
    unknown = [k for k in only if k not in RUNS]
    if unknown:
        parser.error(f"--only: unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    digests = record(os.path.abspath(args.workdir), only)
    if args.record:
        with open(args.record, "w") as f:
            json.dump(digests, f, indent=1, sort_keys=True)
        print(f"recorded {', '.join(only)} in {args.record}")
        return 0
    with open(args.compare) as f:
        old = json.load(f)
    problems = compare({k: v for k, v in old.items() if k in only}, digests)
    for problem in problems:
        print(problem)
    print("same behaviour" if not problems else f"{len(problems)} difference(s)")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
