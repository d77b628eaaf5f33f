"""Behaviour-identity check for refactors: same log lines, same checkpoints, before and after a change.

Runs tiny trainings on CPU (fixed seeds, fp32, gloo), one process each unless said: gpt, llama (RMSNorm, SwiGLU,
RoPE, GQA, untied), bert, t5, gpt_deepspeed (DeepSpeed ZeRO-1), bloom (ALiBi with 6 heads, --embed-layernorm),
mixtral_ep2 (Mixtral-style MoE: 4 experts in every layer, top-2, load-balancing and z losses logged; expert
parallelism 2 on 2 processes) and gpt_cp2 (GPT under context parallelism 2 on 2 processes). The ranks of a run are
started as torchrun starts them (RANK, WORLD_SIZE, MASTER_PORT ... in their environment), each with its own stdout.
Each run of 6 iterations (validation and a checkpoint every 2) stops at iteration 4 (--exit-interval), then a
second run resumes from that checkpoint to the end. The record holds, per run:

- the log lines (stdout) of every rank (``log``/``log_resumed`` for rank 0, ``log.rank1`` ... for the others) with
  timings masked: per-iteration time, samples per second, TFLOPs, datetimes, timers, "... in N seconds" and the
  time-to-initialise line; paths under the work folder are written as ``<WORK>``;
- per checkpoint file (every rank's): the sha256 of its bytes and a digest of its content (every tensor's dtype,
  shape and bytes; every other value as text, ``args`` as a sorted mapping; the classes its pickle names, whose
  module paths are in its bytes). Volatile fields excluded from the
  content digest (and the byte check of the files holding them): none in our Megatron files (their bytes are
  compared); DeepSpeed's files are compared by content (``ds_version`` and the pickled engine objects of
  DeepSpeed's own bookkeeping are kept as text), ``manifest.json`` by its file names and sizes (its CRCs follow the
  bytes).

Usage::

    python tools/check_same_behaviour.py --record before.json --workdir /tmp/csb   # on the commit before the change
    python tools/check_same_behaviour.py --compare before.json    # after: exit 1 and a diff when anything differs

A change that adds flags compares with ``--allow-new-settings``: a setting the record does not know, printed or
saved at its default value, is then not a difference (the argument dump's new lines, the checkpoints' new ``args`` and
``architecture`` fields, and so their bytes and manifests); everything else must still be the same.

``--only gpt,bloom`` limits the runs (names: gpt, llama, bert, t5, gpt_deepspeed, bloom, mixtral_ep2, gpt_cp2).
``--workdir`` is the scratch folder (emptied first; one check at a time per folder, a second one waits). A compare
must run in the folder the record was made in: the checkpoints' ``args`` hold paths under it (``--save``,
``--data-path``), so their bytes differ in any other folder (and so with another data folder, MEGATRON_SHARED_DATA
or else /work/shared/data, or else tests/fixtures). The record keeps its folder, and ``--compare`` uses it
when ``--workdir`` is not given (and refuses another one).
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import fcntl
import hashlib
import io
import json
import os
import pickletools
import re
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from typing import Any, Iterator, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("MEGATRON_SHARED_DATA", "/work/shared/data")
if not os.path.isdir(os.path.join(DATA, "openwebtext-1000")):  # a fresh clone: the same first documents and vocabs
    DATA = os.path.join(ROOT, "tests", "fixtures")
DEFAULT_WORKDIR = os.path.join("/tmp", f"check_same_behaviour-{os.getuid()}")
NUM_DOCS = 40
META = "_record"  # the record's own entry: the work folder it ran in, its runs

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
    """The script and flags of one run (every run: 6 iterations, validation and a checkpoint every 2)."""
    shape = ["--hidden-size", "48", "--num-attention-heads", "6"] if kind == "bloom" else \
        ["--hidden-size", "32", "--num-attention-heads", "4"]
    common = [*shape, "--micro-batch-size", "2",
              "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3", "--min-lr", "1e-4",
              "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--weight-decay",
              "0.01", "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--save-interval", "2",
              "--num-workers", "0", "--seed", "1234", "--log-params-norm", "--log-num-zeros-in-grad"]
    gpt = ["--num-layers", "2", "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-file",
           data["gpt_vocab"], "--merge-file", data["gpt_merges"], "--data-path", data["gpt_prefix"],
           "--split", "90,10,0"]
    if kind in _GPT_EXTRA:
        return "pretrain_gpt.py", common + gpt + [data[a] if a in data else a for a in _GPT_EXTRA[kind]]
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


_LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--group-query-attention",
          "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
          "--ffn-hidden-size", "48"]
# The GPT-script runs: flags after the tiny GPT's (a name of a prepared file, such as ds_config, is replaced by its
# path). bloom: ALiBi (6 heads, not a power of two) and the LayerNorm after the embeddings; mixtral_ep2: a
# Mixtral-style MoE (every layer 4 experts, top-2, load-balancing and z losses) with its experts over 2 ranks.
_GPT_EXTRA = {
    "gpt": [],
    "llama": _LLAMA,
    "gpt_deepspeed": ["--deepspeed", "--deepspeed_config", "ds_config"],
    "bloom": ["--position-embedding-type", "alibi", "--embed-layernorm"],
    "mixtral_ep2": [*_LLAMA, "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
                    "aux_loss", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
                    "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2"],
    "gpt_cp2": ["--context-parallel-size", "2"],
}
RUNS = ("gpt", "llama", "bert", "t5", "gpt_deepspeed", "bloom", "mixtral_ep2", "gpt_cp2")
PROCESSES = {"mixtral_ep2": 2, "gpt_cp2": 2}  # ranks per run (1 when absent): gloo processes on this machine


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


def _pickled_classes(raw: bytes) -> list[str]:
    """The classes and functions a torch.save file's pickle names (``module.name``): their paths are in its bytes."""
    names: set[str] = set()
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        for member in archive.namelist():
            if not member.endswith("data.pkl"):
                continue
            strings: list[str] = []
            for op, arg, _ in pickletools.genops(archive.read(member)):
                if op.name == "GLOBAL":
                    names.add(arg.replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    names.add(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
    return sorted(names)


def _file_difference(fa: dict, fb: dict) -> list[str]:
    """What differs between two digests of one checkpoint file, a line each."""
    detail = []
    for field in sorted(set(fa.get("content", {})) | set(fb.get("content", {}))):
        va, vb = fa.get("content", {}).get(field), fb.get("content", {}).get(field)
        if va != vb:
            detail.append(f"    {field}: {va} -> {vb}")
    ca, cb = set(fa.get("classes", ())), set(fb.get("classes", ()))
    if ca != cb:
        detail.append(f"    pickled classes: {', '.join(sorted(ca - cb)) or '-'} -> {', '.join(sorted(cb - ca)) or '-'}")
    if "text" in fa and "text" in fb and fa["text"] != fb["text"]:
        diff = difflib.unified_diff(fa["text"].splitlines(), fb["text"].splitlines(), lineterm="", n=0)
        detail.extend(f"    {line}" for line in list(diff)[2:])
    if not detail:
        detail.append("    bytes differ (same content)" if "sha256" in fa else f"    {fa} -> {fb}")
    return detail


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
        entry["classes"] = _pickled_classes(raw)
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
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(kind: str, argv: list[str], work: str, logs: str) -> list[str]:
    """Start the run's ranks as torchrun would (RANK, WORLD_SIZE, ... in the environment, gloo on CPU), each with
    its own stdout file, and wait for all; a failed rank stops the others. Returns the stdout file per rank."""
    world = PROCESSES.get(kind, 1)
    port = os.environ.get("CHECK_SAME_BEHAVIOUR_PORT") or str(_free_port())
    procs, outs = [], []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONHASHSEED": "0",
               "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "CROSS_RANK": "0", "CROSS_SIZE": "1", "GROUP_RANK": "0"}
        outs.append(f"{logs}.rank{rank}")
        with open(outs[-1], "w") as out, open(outs[-1] + ".err", "w") as err:
            procs.append(subprocess.Popen(argv, cwd=work, env=env, stdout=out, stderr=err))
    deadline = time.monotonic() + 900
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    stopped = [p.poll() is None for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    failed = sorted(((rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0),
                    key=lambda fail: stopped[fail[0]])  # a rank that failed by itself first, then those stopped
    if failed:
        rank = failed[0][0]
        with open(outs[rank]) as f, open(outs[rank] + ".err") as e:
            raise SystemExit(f"{kind}: {argv[1]} rank {rank} exited {failed[0][1]}:\n{f.read()[-3000:]}\n"
                             f"{e.read()[-3000:]}")
    return outs


def _train(kind: str, data: dict, work: str, load: Optional[str], save: str) -> dict[str, list[str]]:
    """One run; its log lines per rank: ``log`` (rank 0) and ``log.rank1``... (the others), masked."""
    script, argv = _run_argv(kind, data)
    argv = argv + ["--save", save] + (["--load", load] if load else ["--exit-interval", "4"])
    phase = "log_resumed" if load else "log"
    outs = _launch(kind, [sys.executable, os.path.join(ROOT, script), *argv], work,
                   os.path.join(work, "logs", f"{kind}.{phase}"))
    logs = {}
    for rank, path in enumerate(outs):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [_normalise_line(line, work) for line in f.read().splitlines()]
        logs[phase + (f".rank{rank}" if rank else "")] = [line for line in lines if line is not None]
    return logs


def record(work: str, only: list[str]) -> dict:
    """Run every selected training twice (fresh, then resumed) and return the digests."""
    if os.path.isdir(work):
        shutil.rmtree(work)
    os.makedirs(os.path.join(work, "logs"))
    data = _prepare_data(work)
    out: dict = {}
    for kind in only:
        save = os.path.join(work, f"ckpt_{kind}")
        first = _train(kind, data, work, None, save)
        resumed = _train(kind, data, work, save, save)
        out[kind] = {**first, **resumed, "checkpoints": _checkpoint_digest(save, work)}
        print(f"{kind}: {len(first['log'])} + {len(resumed['log_resumed'])} log lines (rank 0) on "
              f"{PROCESSES.get(kind, 1)} rank(s), {len(out[kind]['checkpoints'])} checkpoint files", flush=True)
    return out


_ARG_LINE = re.compile(r"^  (\w+) \.* (.*)$")  # a line of Megatron's argument dump (no dots after a 48-character name)


def setting_defaults() -> dict[str, Any]:
    """dest -> default of every flag this tree's parser declares (what --allow-new-settings compares against)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from megatron.arguments import build_parser

    return {action.dest: action.default for action in build_parser()._actions if action.dest != "help"}


def _drop_new_arg_lines(a: list[str], b: list[str], defaults: dict[str, Any], seen: set[str]) -> list[str]:
    """`b` without the argument-dump lines of settings `a` never printed whose value is their default."""
    before = {m.group(1) for m in map(_ARG_LINE.match, a) if m}
    kept = []
    for line in b:
        m = _ARG_LINE.match(line)
        if m and m.group(1) not in before and m.group(1) in defaults and m.group(2) == str(defaults[m.group(1)]):
            seen.add(m.group(1))
            continue
        kept.append(line)
    return kept


def _drop_new_fields(fa: dict, fb: dict, defaults: dict[str, Any], seen: set[str]) -> dict:
    """`fb` without the content fields (``.args.NAME``, ``.architecture.NAME``) `fa` lacks whose value is NAME's
    default; its sha256 is `fa`'s when nothing else differs (the bytes then differ by those fields only)."""
    ca, cb = fa.get("content", {}), fb.get("content", {})
    new = {key for key in set(cb) - set(ca) if key.split(".")[1:2] in (["args"], ["architecture"])
           and key.split(".")[-1] in defaults and cb[key] == repr(defaults[key.split(".")[-1]])}
    if not new:
        return fb
    seen.update(key.split(".")[-1] for key in new)
    out = {**fb, "content": {k: v for k, v in cb.items() if k not in new}}
    if out["content"] == ca and out.get("classes") == fa.get("classes") and "sha256" in fa:
        out["sha256"] = fa["sha256"]
    return out


def _manifest_sizes_only(fa: dict, fb: dict) -> bool:
    """Two manifest.json digests that differ only in their files' sizes and CRCs (ours: text; DeepSpeed's: sizes)."""
    if "manifest" in fa and "manifest" in fb:
        return set(fa["manifest"]) == set(fb["manifest"])
    strip = re.compile(r'"(crc32|size)": [^,}\n]*')
    return "text" in fa and "text" in fb and strip.sub("", fa["text"]) == strip.sub("", fb["text"])


def compare(old: dict, new: dict, defaults: Optional[dict[str, Any]] = None,
            seen: Optional[set[str]] = None) -> list[str]:
    """Human-readable differences (empty when identical). With `defaults` (``--allow-new-settings``), settings the
    record does not know that appear at their default value (in the argument dump, the checkpoints' args and
    architecture record, and hence the checkpoint files' bytes and manifests) are not differences; their names are
    added to `seen`."""
    problems, seen = [], set() if seen is None else seen
    for kind in sorted(set(old) | set(new)):
        if kind not in old or kind not in new:
            problems.append(f"{kind}: only in {'the record' if kind in old else 'this run'}")
            continue
        for key in sorted(k for k in set(old[kind]) | set(new[kind]) if k != "checkpoints"):
            a, b = old[kind].get(key, []), new[kind].get(key, [])
            if defaults is not None:
                b = _drop_new_arg_lines(a, b, defaults, seen)
            if a != b:
                diff = list(difflib.unified_diff(a, b, "recorded", "now", lineterm="", n=1))
                problems.append(f"{kind} {key}:\n" + "\n".join(diff[:40]))
        ca, cb = old[kind]["checkpoints"], new[kind]["checkpoints"]
        if defaults is not None:
            cb = {name: _drop_new_fields(ca[name], fb, defaults, seen) if name in ca else fb
                  for name, fb in cb.items()}
        for name in sorted(set(ca) | set(cb)):
            if name not in ca or name not in cb:
                problems.append(f"{kind}: checkpoint file {name} only in {'the record' if name in ca else 'this run'}")
            elif ca[name] != cb[name] and not (defaults is not None and name.endswith("manifest.json")
                                               and _manifest_sizes_only(ca[name], cb[name])
                                               and _folder_same(ca, cb, os.path.dirname(name))):
                problems.append(f"{kind}: {name} differs:\n" + "\n".join(_file_difference(ca[name], cb[name])[:20]))
    return problems


def _folder_same(ca: dict, cb: dict, folder: str) -> bool:
    """Every file under `folder` but its manifest the same in both digests (after new settings were dropped)."""
    names = {n for n in set(ca) | set(cb) if n.startswith(folder + "/") and not n.endswith("manifest.json")}
    return all(ca.get(n) == cb.get(n) for n in names)


def _workdir_for(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """--workdir, or for a compare the record's own (the checkpoints' args hold paths under it: bytes follow)."""
    if not args.compare:
        return os.path.abspath(args.workdir or DEFAULT_WORKDIR)
    with open(args.compare) as f:
        recorded = json.load(f).get(META, {}).get("workdir")
    if recorded is None:
        return os.path.abspath(args.workdir or DEFAULT_WORKDIR)
    if args.workdir and os.path.abspath(args.workdir) != recorded:
        parser.error(f"--workdir {args.workdir}: {args.compare} was recorded in {recorded} (the checkpoints' args "
                     f"hold paths under it, so their bytes differ elsewhere): pass --workdir {recorded} or omit it")
    return recorded


@contextlib.contextmanager
def _exclusive(work: str) -> Iterator[None]:
    """One check at a time per work folder (a second one waits): each empties the folder first. A POSIX record lock
    (lockf), which Linux keeps apart from flock(1)'s: a check run under ``flock WORK.lock ...`` does not wait on its
    own wrapper."""
    with open(work.rstrip("/") + ".lock", "w") as lock:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"waiting for another check using {work} ...", flush=True)
            fcntl.lockf(lock, fcntl.LOCK_EX)
        yield


def main(argv: Optional[list[str]] = None) -> int:
    """Record the digests of this tree's runs, or compare them with a record (exit 1 on a difference)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--record", metavar="FILE", help="write the digests of this tree's runs to FILE")
    group.add_argument("--compare", metavar="FILE", help="run again and compare with FILE (exit 1 on a difference)")
    parser.add_argument("--only", default=",".join(RUNS), help=f"comma-separated runs out of {','.join(RUNS)}")
    parser.add_argument("--workdir", default=None,
                        help=f"scratch folder, emptied first (--record: default {DEFAULT_WORKDIR}; --compare: must "
                             "be the record's own, the default)")
    parser.add_argument("--allow-new-settings", action="store_true",
                        help="with --compare: settings the record does not know, at their default value, are not "
                             "differences (for a change that adds flags; a refactor compares strictly)")
    args = parser.parse_args(argv)
    only = [k for k in args.only.split(",") if k]
    unknown = [k for k in only if k not in RUNS]
    if unknown:
        parser.error(f"--only: unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    work = _workdir_for(args, parser)
    with _exclusive(work):
        digests = record(work, only)
    if args.record:
        with open(args.record + ".part", "w") as f:  # then renamed: a compare reading it never sees half a record
            json.dump({META: {"workdir": work, "data": DATA, "runs": only}, **digests}, f, indent=1, sort_keys=True)
        os.replace(args.record + ".part", args.record)
        print(f"recorded {', '.join(only)} in {args.record}")
        return 0
    with open(args.compare) as f:
        old = json.load(f)
    seen: set[str] = set()
    problems = compare({k: v for k, v in old.items() if k in only}, digests,
                       setting_defaults() if args.allow_new_settings else None, seen)
    for problem in problems:
        print(problem)
    if seen:
        print(f"new settings at their defaults (not differences): {len(seen)}: {', '.join(sorted(seen))}")
    print("same behaviour" if not problems else f"{len(problems)} difference(s)")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
