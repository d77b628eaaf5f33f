"""Shared engine of tools/preprocess_data.py and tools/preprocess_data_many_cores.py: JSON lines -> .bin/.idx.

Semantics are Megatron's: one JSON line is one document; for each `--json-keys` key its text (or, with
`--split-sentences`, each Punkt sentence; a JSON list of strings is taken as already-split sentences) is tokenized,
empty sentences are dropped, `--append-eod` appends eod to the document's last sentence, and a document whose key
yields no tokens is skipped for that key (and counted). Output is `{prefix}_{key}_{document|sentence}.{bin,idx}`
written through megatron.data.indexed_dataset. Bad lines stop the run with `file:line: reason` unless
`--skip-bad-lines`. Blank lines are ignored. Output bytes do not depend on --workers or --chunk-size.

Speed: no torch; orjson when installed; input read in big blocks of whole lines; each task's sentences are
tokenized in one batch; tokens leave the workers as numpy arrays; one pool of forked workers, results in order.
"""
from __future__ import annotations

import argparse
import gc
import glob
import gzip
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from itertools import chain
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from megatron.data import indexed_dataset as ids
from megatron.data.sentence_splitter import SentenceSplitter
from megatron.settings.cli_parser import FlagParser
from megatron.tokenizer import build_tokenizer

try:
    import orjson as _orjson

    _loads = _orjson.loads
    _JSONError: tuple = (_orjson.JSONDecodeError,)
except ImportError:  # pragma: no cover - orjson is optional
    import json as _json

    _orjson = None
    _JSONError = (ValueError,)

    def _loads(data: bytes) -> Any:
        return _json.loads(data)

MIN_TASK_BYTES = 256 * 1024
MAX_BAD_LINE_REPORTS = 5


class PreprocessError(RuntimeError):
    """A one-line, user-facing error (the tools print it and exit 1)."""


# ----------------------------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------------------------
def add_preprocess_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="input data")
    g.add_argument("--input", type=str, nargs="+", required=True,
                   help="JSON-lines input file(s); .gz is read transparently; glob patterns are expanded (sorted)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    g.add_argument("--split-sentences", action="store_true",
                   help="split documents into sentences with NLTK Punkt, offline: NLTK's installed model for --lang "
                        "if its data is present, else (English) the Punkt parameters bundled in "
                        "megatron/data/punkt_english.json; nothing is ever downloaded")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences when splitting")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines (bad JSON / UTF-8, missing key, non-string value) and report how many; "
                        "by default the first one stops the run with file:line: reason")

    g = parser.add_argument_group(title="tokenizer")
    g.add_argument("--tokenizer-type", type=str, required=True,
                   choices=["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                            "SentencePieceTokenizer", "Llama2Tokenizer", "PretrainedFromHF", "HuggingFaceTokenizer",
                            "NullTokenizer"])
    g.add_argument("--vocab-file", "--vocab", dest="vocab_file", type=str, default=None, help="path to the vocab file")
    g.add_argument("--merge-file", type=str, default=None, help="path to the BPE merge file")
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="sentencepiece model file (HuggingFaceTokenizer: local folder with tokenizer.json)")
    g.add_argument("--tokenizer-name-or-path", type=str, default=None, help="local HF tokenizer directory")
    g.add_argument("--vocab-size", type=int, default=786, help="vocab size for NullTokenizer")
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="number of T5 <extra_id_N> sentinel tokens")
    g.add_argument("--append-eod", action="store_true", help="append an <eod> token to the end of each document")
    g.add_argument("--lang", type=str, default="english", help="language for NLTK Punkt sentence splitting")

    g = parser.add_argument_group(title="output data")
    g.add_argument("--output-prefix", type=str, required=True, help="path of the output files without suffix")
    g.add_argument("--allow-empty", action="store_true",
                   help="write the output even when no document yields tokens (default: that is an error)")
    g.add_argument("--dataset-impl", type=str, default="mmap", choices=["lazy", "cached", "mmap"])

    g = parser.add_argument_group(title="runtime")
    g.add_argument("--workers", type=int, default=1, help="number of worker processes")
    g.add_argument("--chunk-size", type=int, default=25,
                   help="minimum number of lines per worker task (a task also holds at least 256 KiB of input)")
    g.add_argument("--log-interval", type=int, default=1000, help="print progress every this many documents")
    return parser


def get_parser(description: str = "Tokenize JSON lines into Megatron .bin/.idx files") -> argparse.ArgumentParser:
    return add_preprocess_args(FlagParser(description=description))


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Validate flags and add the dummy values build_tokenizer reads (as Megatron's tool does)."""
    for flag in ("workers", "chunk_size", "log_interval"):
        if getattr(args, flag) < 1:
            raise PreprocessError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.keep_newlines and not args.split_sentences:
        print("note: --keep-newlines only matters with --split-sentences", file=sys.stderr)
    if args.tokenizer_type.lower().startswith("bert") and not args.split_sentences:
        print("Bert tokenizer detected, are you sure you don't want to split sentences?", file=sys.stderr)
    args.rank = 1  # build_tokenizer prints nothing (Megatron's tool does the same)
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise PreprocessError(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PreprocessError(f"--output-prefix {args.output_prefix}: directory {out_dir} is not writable; choose "
                              "another --output-prefix")
    remove_stale_outputs(args.output_prefix)
    return args


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_outputs(output_prefix: str) -> List[str]:
    """Temporary files of earlier runs on this prefix that were killed (SIGKILL, power loss): ``*.tmp-<pid>`` and
    ``*.part<i>-<pid>.bin/.idx`` whose process is gone. Removed, and named in one line."""
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    base = os.path.basename(output_prefix)
    pattern = re.compile(r"(?:\.tmp-(\d+)|\.part\d{3}-(\d+)\.(?:bin|idx)(?:\.tmp-\d+)?)$")
    removed = []
    for name in os.listdir(out_dir):
        m = pattern.search(name)
        if not name.startswith(base) or not m:
            continue
        pid = int(m.group(1) or m.group(2))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            os.remove(os.path.join(out_dir, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        print(f"note: removed {len(removed)} temporary file(s) of an interrupted earlier run (e.g. {removed[0]})",
              file=sys.stderr)
    return removed


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    files: List[str] = []
    for pat in patterns:
        if any(c in pat for c in "*?["):
            found = sorted(p for p in glob.glob(pat) if os.path.isfile(p))
            if not found:
                raise PreprocessError(f"--input {pat}: the pattern matches no file")
            files.extend(found)
        elif os.path.isfile(pat):
            files.append(pat)
        else:
            raise PreprocessError(f"--input {pat}: file not found")
    return files


def output_prefixes(args: argparse.Namespace) -> Dict[str, str]:
    level = "sentence" if args.split_sentences else "document"
    return {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}


# ----------------------------------------------------------------------------------------------------------------
# reading: tasks of whole lines
# ----------------------------------------------------------------------------------------------------------------
class Task(NamedTuple):
    path: str
    first_line: int  # 1-based line number of the first line in data
    data: bytes  # complete lines


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


class Segment(NamedTuple):
    path: str
    start: int = 0  # byte offset of a line start
    end: Optional[int] = None  # byte offset (exclusive) of a line start, None = end of file
    first_line: int = 1


def iter_tasks(files: Sequence[Any], min_lines: int, min_bytes: int = MIN_TASK_BYTES) -> Iterator[Task]:
    """Yield blocks of complete lines (>= min_bytes and >= min_lines, except a segment's last block).

    `files` holds paths or Segments (byte ranges of uncompressed files, cut at line starts).
    """
    for seg in files:
        seg = seg if isinstance(seg, Segment) else Segment(seg)
        path, line_no, pending = seg.path, seg.first_line, b""
        remaining = None if seg.end is None else seg.end - seg.start
        try:
            with _open(path) as f:
                if seg.start:
                    f.seek(seg.start)
                while remaining is None or remaining > 0:
                    block = f.read(min_bytes if remaining is None else min(min_bytes, remaining))
                    if not block:
                        break
                    if remaining is not None:
                        remaining -= len(block)
                    pending += block
                    cut = pending.rfind(b"\n") + 1
                    if cut == 0 or cut < min_bytes:
                        continue
                    n_lines = pending.count(b"\n", 0, cut)
                    if n_lines < min_lines:
                        continue
                    yield Task(path, line_no, pending[:cut])
                    line_no += n_lines
                    pending = pending[cut:]
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise PreprocessError(f"{path}: cannot read input ({exc})") from None
        if pending:
            yield Task(path, line_no, pending)


def _count_lines(f: Any, start: int, end: int, block: int = 1 << 24) -> int:
    f.seek(start)
    n, left = 0, end - start
    while left > 0:
        data = f.read(min(block, left))
        if not data:
            break
        n += data.count(b"\n")
        left -= len(data)
    return n


def partition_inputs(files: Sequence[str], parts: int) -> List[List[Segment]]:
    """Split the inputs into `parts` contiguous runs of whole lines of about equal size (.gz files are not split)."""
    sizes = [os.path.getsize(p) for p in files]
    total = sum(sizes)
    target = max(1, -(-total // parts))
    out: List[List[Segment]] = [[] for _ in range(parts)]
    part, filled = 0, 0
    for path, size in zip(files, sizes):
        if path.endswith(".gz") or size == 0:
            out[part].append(Segment(path))
            filled += size
            if filled >= target and part < parts - 1:
                part, filled = part + 1, 0
            continue
        with open(path, "rb") as f:
            start, line = 0, 1
            while start < size:
                want = start + max(1, target - filled)
                if part == parts - 1 or want >= size:
                    end = size
                else:
                    f.seek(want)
                    f.readline()  # move to the next line start
                    end = min(f.tell(), size)
                n_lines = _count_lines(f, start, end)
                out[part].append(Segment(path, start, end, line))
                filled += end - start
                start, line = end, line + n_lines
                if filled >= target and part < parts - 1:
                    part, filled = part + 1, 0
    return out


# ----------------------------------------------------------------------------------------------------------------
# encoding (runs in the workers)
# ----------------------------------------------------------------------------------------------------------------
class KeyResult(NamedTuple):
    tokens: np.ndarray  # all kept sentences of the task, concatenated
    sizes: np.ndarray  # int64 sentence lengths
    doc_sentences: np.ndarray  # int64 number of sentences of each kept document
    empty_docs: int


class TaskResult(NamedTuple):
    num_docs: int
    num_bytes: int
    keys: Dict[str, KeyResult]
    bad_lines: List[str]  # "file:line: reason"


def _slow_loads(line: bytes) -> Tuple[Any, Optional[str]]:
    """The standard json module's view of a line orjson rejected: (object, None) or (None, reason)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 (byte {exc.start})"
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"malformed JSON ({exc})"


def _has_surrogates(value: Any) -> bool:
    strings = [value] if isinstance(value, str) else value
    try:
        for s in strings:
            if isinstance(s, str):
                s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class Encoder:
    """Per-process tokenizer (+ sentence splitter) turning a Task into token arrays."""

    def __init__(self, args: argparse.Namespace, tokenizer: Any = None):
        self.args = args
        self.keys = list(args.json_keys)
        self.tokenizer = tokenizer if tokenizer is not None else build_tokenizer(args)
        self.eod: Optional[int] = None
        if args.append_eod:
            try:
                self.eod = int(self.tokenizer.eod)
            except (AttributeError, NotImplementedError):
                raise PreprocessError(f"--append-eod: --tokenizer-type {args.tokenizer_type} has no eod token") from None
        if args.dataset_impl == "mmap":
            self.dtype = np.dtype(ids.best_fitting_dtype(self.tokenizer.vocab_size))
        else:
            self.dtype = np.dtype(np.int32)
        self.splitter = None
        if args.split_sentences:
            self.splitter = SentenceSplitter(args.lang, args.keep_newlines)

    def _parse(self, task: Task) -> Tuple[List[List[List[str]]], List[str], int]:
        """Per document, per key: the list of sentences; plus bad-line messages."""
        docs: List[List[List[str]]] = []
        bad: List[str] = []
        lines = task.data.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()
        split = self.splitter
        for offset, line in enumerate(lines):
            if not line.strip():
                continue
            checked = True
            try:
                obj = _loads(line)
            except _JSONError:  # orjson is stricter than json (NaN, lone surrogates): ask json what it is
                obj, why = _slow_loads(line)
                if why is not None:
                    bad.append(f"{task.path}:{task.first_line + offset}: {why}")
                    continue
                checked = False
            reason = None
            per_key: List[List[str]] = []
            if not isinstance(obj, dict):
                reason = f"expected a JSON object, got {type(obj).__name__}"
            else:
                for key in self.keys:
                    if key not in obj:
                        reason = f"missing key '{key}' (--json-keys {' '.join(self.keys)})"
                        break
                    value = obj[key]
                    if not checked and isinstance(value, (str, list)) and _has_surrogates(value):
                        reason = f"key '{key}' holds a lone surrogate escape (not valid Unicode text)"
                        break
                    if isinstance(value, str):
                        per_key.append(split(value) if split is not None else [value])
                    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
                        per_key.append(value)  # already split into sentences
                    else:
                        reason = f"key '{key}' is {type(value).__name__}, expected a string"
                        break
            if reason is not None:
                bad.append(f"{task.path}:{task.first_line + offset}: {reason}")
                continue
            docs.append(per_key)
        return docs, bad, len(task.data)

    def encode_task(self, task: Task) -> TaskResult:
        docs, bad, num_bytes = self._parse(task)
        if bad and not self.args.skip_bad_lines:
            return TaskResult(0, num_bytes, {}, bad[:1])
        results: Dict[str, KeyResult] = {}
        for k, key in enumerate(self.keys):
            counts = [len(d[k]) for d in docs]
            sentences = list(chain.from_iterable(d[k] for d in docs))
            flat = getattr(self.tokenizer, "tokenize_flat", None)
            try:
                if flat is not None:  # ids as one array: no per-sentence lists (BERT WordPiece)
                    results[key] = self._pack_flat(*flat(sentences), counts)
                    continue
                ids = self.tokenizer.tokenize_batch(sentences)
            except ValueError as exc:  # e.g. NullTokenizer on non-numeric text
                raise PreprocessError(f"{task.path}: key '{key}': {exc}") from None
            results[key] = self._pack(ids, counts)
        return TaskResult(len(docs), num_bytes, results, bad)

    def _pack_flat(self, ids: np.ndarray, lengths: np.ndarray, counts: List[int]) -> KeyResult:
        """_pack for ids given as one array plus per-sentence lengths, in numpy: same KeyResult."""
        counts_a = np.asarray(counts, dtype=np.int64)
        doc_of = np.repeat(np.arange(counts_a.size), counts_a)
        keep = lengths > 0
        kept_per_doc = np.bincount(doc_of[keep], minlength=counts_a.size)
        nonempty = kept_per_doc > 0
        doc_sentences = kept_per_doc[nonempty].astype(np.int64)
        sizes = lengths[keep].astype(np.int64)
        tokens = ids
        if self.eod is not None and sizes.size:
            last = np.cumsum(doc_sentences) - 1  # each document's last kept sentence
            tokens = np.insert(ids, np.cumsum(sizes)[last], self.eod)
            sizes[last] += 1
        info = np.iinfo(self.dtype)
        if tokens.size and (int(tokens.min()) < info.min or int(tokens.max()) > info.max):
            raise PreprocessError(f"a token id does not fit the output dtype {self.dtype.name}")
        return KeyResult(tokens.astype(self.dtype, copy=False), sizes, doc_sentences, int(counts_a.size - nonempty.sum()))

    def _pack(self, ids: List[List[int]], counts: List[int]) -> KeyResult:
        kept: List[List[int]] = []
        doc_sentences: List[int] = []
        empty = 0
        eod = self.eod
        pos = 0
        for n in counts:
            doc = [s for s in ids[pos:pos + n] if len(s) > 0]
            pos += n
            if not doc:
                empty += 1
                continue
            if eod is not None:
                doc[-1] = [*doc[-1], eod]
            kept.extend(doc)
            doc_sentences.append(len(doc))
        sizes = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
        total = int(sizes.sum())
        try:
            tokens = np.fromiter(chain.from_iterable(kept), dtype=self.dtype, count=total)
        except OverflowError:
            raise PreprocessError(f"a token id does not fit the output dtype {self.dtype.name}") from None
        return KeyResult(tokens, sizes, np.asarray(doc_sentences, dtype=np.int64), empty)


_WORKER_ENCODER: Optional[Encoder] = None


def _worker_init(args: argparse.Namespace) -> None:
    global _WORKER_ENCODER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C/SIGTERM and stops the pool: no
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # tracebacks from workers
    if _WORKER_ENCODER is None:  # forked workers inherit the parent's encoder
        _WORKER_ENCODER = Encoder(args)


def _worker_encode(task: Task) -> Any:
    try:
        return _WORKER_ENCODER.encode_task(task)  # type: ignore[union-attr]
    except PreprocessError as exc:
        return exc


# ----------------------------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------------------------
class Writers:
    """One builder per key; published (renamed to final names) only by finalize(); abort() removes everything."""

    def __init__(self, prefixes: Dict[str, str], impl: str, vocab_size: int):
        self._ids = ids
        self.prefixes = prefixes
        self.builders: Dict[str, Any] = {}
        try:
            for key, prefix in prefixes.items():
                self.builders[key] = ids.make_builder(ids.data_file_path(prefix), impl=impl, vocab_size=vocab_size)
        except BaseException:
            self.abort()
            raise

    def add(self, key: str, result: KeyResult) -> None:
        builder = self.builders[key]
        tokens, sizes = result.tokens, result.sizes
        t = s = 0
        for n in result.doc_sentences.tolist():
            doc_sizes = sizes[s:s + n]
            length = int(doc_sizes.sum())
            builder.add_doc(tokens[t:t + length], doc_sizes)
            t += length
            s += n

    def merge(self, key: str, prefix: str) -> None:
        self.builders[key].merge_file_(prefix)

    def finalize(self) -> None:
        ids = self._ids
        for key, prefix in self.prefixes.items():
            idx = ids.index_file_path(prefix)
            if os.path.exists(idx):  # never pair a new .bin with a stale .idx, even for an instant
                os.remove(idx)
            self.builders[key].finalize(idx)

    def abort(self) -> None:
        for builder in self.builders.values():
            try:
                builder.abort()
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass


class Stats:
    def __init__(self, log_interval: int, quiet: bool = False):
        self.docs = 0
        self.bytes = 0
        self.bad: List[str] = []
        self.empty: Dict[str, int] = {}
        self.tokens: Dict[str, int] = {}
        self.start = time.time()
        self.log_interval = log_interval
        self.quiet = quiet

    def update(self, res: TaskResult) -> None:
        before = self.docs
        self.docs += res.num_docs
        self.bytes += res.num_bytes
        self.bad.extend(res.bad_lines)
        for key, kr in res.keys.items():
            self.empty[key] = self.empty.get(key, 0) + kr.empty_docs
            self.tokens[key] = self.tokens.get(key, 0) + int(kr.tokens.size)
        if not self.quiet and self.docs // self.log_interval > before // self.log_interval:
            self.log()

    def log(self) -> None:
        elapsed = max(time.time() - self.start, 1e-9)
        print(f"Processed {self.docs} documents ({self.docs / elapsed:.2f} docs/s, "
              f"{self.bytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------------------------
def _pool(args: argparse.Namespace, workers: int):
    if "fork" not in mp.get_all_start_methods():
        return mp.get_context("spawn").Pool(workers, initializer=_worker_init, initargs=(args,))
    # Workers are forked with SIGTERM at its default action. With the parent's Python-level handler inherited, a
    # SIGTERM from Pool.terminate() that reaches a worker before it first runs is dropped (CPython clears tripped
    # signals after fork), the worker then blocks on the task queue's lock and Pool.terminate() waits forever.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL) if main else None
    gc.freeze()  # the tokenizer's objects stay shared with the forked workers (no copy-on-write by the GC)
    try:
        return mp.get_context("fork").Pool(workers, initializer=_worker_init, initargs=(args,))
    finally:
        gc.unfreeze()  # the workers exist now; the parent goes back to normal collection
        if main:
            signal.signal(signal.SIGTERM, previous)


def encode_results(args: argparse.Namespace, encoder: Encoder, tasks: Iterator[Task], workers: int) -> Iterator[Any]:
    """TaskResults (or PreprocessError) in input order, from this process or a pool of workers."""
    global _WORKER_ENCODER
    if workers <= 1:
        for task in tasks:
            try:
                yield encoder.encode_task(task)
            except PreprocessError as exc:
                yield exc
        return
    if args.tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase", "PretrainedFromHF", "HuggingFaceTokenizer"):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_ENCODER = encoder  # inherited by forked workers: no second tokenizer load
    pool = _pool(args, workers)
    try:
        yield from pool.imap(_worker_encode, tasks, chunksize=1)
    finally:
        pool.terminate()
        pool.join()
        _WORKER_ENCODER = None


def consume(results: Iterator[Any], writers: Writers, stats: Stats, args: argparse.Namespace) -> None:
    for res in results:
        if isinstance(res, PreprocessError):
            raise res
        if res.bad_lines and not args.skip_bad_lines:
            raise PreprocessError(f"{res.bad_lines[0]} (use --skip-bad-lines to skip bad lines)")
        for msg in res.bad_lines:
            if len(stats.bad) < MAX_BAD_LINE_REPORTS:
                print(f"warning: skipping {msg}", file=sys.stderr)
        stats.update(res)
        for key, kr in res.keys.items():
            writers.add(key, kr)


def report(stats: Stats, prefixes: Dict[str, str], args: argparse.Namespace) -> None:
    elapsed = max(time.time() - stats.start, 1e-9)
    print(f"Done: {stats.docs} documents, {stats.bytes / 1024 / 1024:.2f} MB in {elapsed:.2f} s "
          f"({stats.bytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr)
    for key, prefix in prefixes.items():
        print(f"  {prefix}.bin/.idx: {stats.tokens.get(key, 0)} tokens; "
              f"{stats.empty.get(key, 0)} documents without tokens skipped", file=sys.stderr)
    if stats.bad:
        print(f"Skipped {len(stats.bad)} bad lines (--skip-bad-lines).", file=sys.stderr)


def run(args: argparse.Namespace) -> Stats:
    """preprocess_data.py: read, encode with --workers processes, write, publish."""
    files = expand_inputs(args.input)
    prefixes = output_prefixes(args)
    encoder = Encoder(args)
    print(f"Opening {' '.join(files)}", file=sys.stderr)
    writers = Writers(prefixes, args.dataset_impl, encoder.tokenizer.vocab_size)
    stats = Stats(args.log_interval)
    results = encode_results(args, encoder, iter_tasks(files, args.chunk_size, MIN_TASK_BYTES), args.workers)
    try:
        consume(results, writers, stats, args)
        results.close()  # stops the worker pool before publishing
        check_not_empty(stats, prefixes, files, args)
        writers.finalize()
    except BaseException:
        results.close()
        writers.abort()
        raise
    report(stats, prefixes, args)
    return stats


def main(run_fn: Any = run, argv: Optional[Sequence[str]] = None, description: Optional[str] = None) -> int:
    """Entry point shared by the tools: one-line errors, exit code 1 (130 when interrupted)."""
    parser = get_parser(description) if description else get_parser()
    args = parser.parse_args(argv)

    def _terminate(signum: int, frame: Any) -> None:
        raise _Terminated(signum)

    previous = signal.signal(signal.SIGTERM, _terminate)  # SIGTERM cleans up like Ctrl-C
    try:
        run_fn(finish_args(args))
    except (PreprocessError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. a read-only or full output folder
        where = exc.filename or args.output_prefix
        print(f"error: cannot write {where}: {exc.strerror or exc}; choose another --output-prefix",
              file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated) as exc:
        print("interrupted: no output was published (temporary files removed)", file=sys.stderr)
        return 143 if isinstance(exc, _Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that the normal cleanup (abort, pool terminate) runs."""


def check_not_empty(stats: Stats, prefixes: Dict[str, str], files: Sequence[str], args: argparse.Namespace) -> None:
    """No document with tokens: an error before anything is published (a counted warning with --allow-empty)."""
    empty_keys = [key for key in prefixes if stats.tokens.get(key, 0) == 0]
    if not empty_keys:
        return
    what = (f"--input {' '.join(files)}: {stats.docs} documents, none with tokens for --json-keys "
            f"{' '.join(empty_keys)} ({sum(stats.empty.get(k, 0) for k in empty_keys)} empty, {len(stats.bad)} bad "
            "lines skipped)")
    if not getattr(args, "allow_empty", False):
        raise PreprocessError(f"{what}; nothing to train on (pass --allow-empty to write empty files anyway)")
    print(f"warning: {what}; writing empty output (--allow-empty)", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------------------
# preprocess_data_many_cores.py: one partition per worker, then merge
# ----------------------------------------------------------------------------------------------------------------
def _encode_partition(job: Tuple[int, List[Segment], Dict[str, str], argparse.Namespace]) -> Any:
    """Encode one partition into its own .bin/.idx files; returns (Stats-like dict) or a PreprocessError."""
    index, segments, prefixes, args = job
    encoder = _WORKER_ENCODER if _WORKER_ENCODER is not None else Encoder(args)
    writers = Writers(prefixes, args.dataset_impl, encoder.tokenizer.vocab_size)
    stats = Stats(args.log_interval, quiet=True)
    try:
        results = (encoder.encode_task(t) for t in iter_tasks(segments, args.chunk_size, MIN_TASK_BYTES))
        consume(results, writers, stats, args)
        writers.finalize()
    except PreprocessError as exc:
        writers.abort()
        return exc
    except BaseException:
        writers.abort()
        raise
    return {"docs": stats.docs, "bytes": stats.bytes, "bad": stats.bad, "empty": stats.empty, "tokens": stats.tokens}


def run_partitioned(args: argparse.Namespace) -> Stats:
    """preprocess_data_many_cores.py: --workers partitions encoded in parallel, merged in order (same output)."""
    global _WORKER_ENCODER
    files = expand_inputs(args.input)
    prefixes = output_prefixes(args)
    encoder = Encoder(args)
    parts = partition_inputs(files, args.workers)
    print(f"Opening {' '.join(files)} in {args.workers} partitions", file=sys.stderr)
    part_prefixes = [{k: f"{p}.part{i:03d}-{os.getpid()}" for k, p in prefixes.items()} for i in range(len(parts))]
    jobs = [(i, seg, part_prefixes[i], args) for i, seg in enumerate(parts)]
    stats = Stats(args.log_interval)

    def cleanup() -> None:
        for pp in part_prefixes:
            for prefix in pp.values():
                for path in (ids.data_file_path(prefix), ids.index_file_path(prefix)):
                    if os.path.exists(path):
                        os.remove(path)

    writers = None
    _WORKER_ENCODER = encoder  # used in this process and inherited by forked workers
    try:
        if args.workers <= 1:
            outcomes = [_encode_partition(job) for job in jobs]
        else:
            if args.tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase", "PretrainedFromHF", "HuggingFaceTokenizer"):
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            pool = _pool(args, args.workers)
            try:
                outcomes = pool.map(_encode_partition, jobs, chunksize=1)
            finally:
                pool.terminate()
                pool.join()
        for outcome in outcomes:  # the first error in input order wins
            if isinstance(outcome, PreprocessError):
                raise outcome
        for outcome in outcomes:
            stats.docs += outcome["docs"]
            stats.bytes += outcome["bytes"]
            stats.bad.extend(outcome["bad"])
            for key in prefixes:
                stats.empty[key] = stats.empty.get(key, 0) + outcome["empty"].get(key, 0)
                stats.tokens[key] = stats.tokens.get(key, 0) + outcome["tokens"].get(key, 0)
        for msg in stats.bad[:MAX_BAD_LINE_REPORTS]:
            print(f"warning: skipping {msg}", file=sys.stderr)
        check_not_empty(stats, prefixes, files, args)
        print(f"Merging {len(parts)} partitions ...", file=sys.stderr)
        writers = Writers(prefixes, args.dataset_impl, encoder.tokenizer.vocab_size)
        for pp in part_prefixes:
            for key, prefix in pp.items():
                writers.merge(key, prefix)
        writers.finalize()
    except BaseException:
        if writers is not None:
            writers.abort()
        raise
    finally:
        _WORKER_ENCODER = None
        cleanup()
    report(stats, prefixes, args)
    return stats
