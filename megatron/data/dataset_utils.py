"""Shared helpers for the pretraining datasets: split parsing, blend weights, index-cache locations, rank-0 logging,
and the sentence-level pieces BERT and T5 share (samples mapping, segments, truncation, masked-LM selection).

Megatron semantics: `--split 969,30,1` (or `969/30/1`) is normalised and turned into document boundaries;
`--data-path 0.3 a 0.7 b` gives weights and prefixes, and each component dataset is asked for 0.5% more samples
than its share so that the blend never runs short. The BERT/T5 helpers make the same random draws in the same order
as Megatron's, so samples match token for token.
"""
from __future__ import annotations

import bisect
import hashlib
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np

from megatron import optional
from megatron.core.rank_print import is_rank_0, print_rank_0  # noqa: F401  (re-exported: Megatron's import path)
from megatron.data.file_lock import file_lock
from megatron.data.helpers import get_helpers
from megatron.data.indexed_dataset import make_dataset
from megatron.errors import MegatronUserError

NumSamples = Union[int, Sequence[int]]


def _dist():
    """torch.distributed if it is initialised, else None (torch is imported lazily)."""
    try:
        dist = optional.torch_distributed()
    except ImportError:  # pragma: no cover - torch is a hard dependency of training, not of this module
        return None
    return dist if dist.is_available() and dist.is_initialized() else None






def is_group_leader(group: Any = None) -> bool:
    """True on the lowest global rank of `group` (default: world), and always without torch.distributed."""
    dist = _dist()
    if dist is None:
        return True
    if group is None:
        return dist.get_rank() == 0
    return dist.get_rank() == min(dist.get_process_group_ranks(group))


def barrier(group: Any = None) -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier(group=group)


def get_train_valid_test_split_(splits_string: str, size: int) -> list[int]:
    """Document boundaries [0, a, b, size] from a "969,30,1" / "969/30/1" / "1" style split string."""
    text = str(splits_string).strip()
    sep = "," if "," in text else "/"
    try:
        splits = [float(s) for s in text.split(sep)] if text else []
    except ValueError as exc:
        raise ValueError(f"--split {splits_string!r}: expected up to three numbers like '969,30,1'") from exc
    if not splits or len(splits) > 3 or any(s < 0 for s in splits) or sum(splits) <= 0:
        raise ValueError(f"--split {splits_string!r}: expected up to three non-negative numbers with a positive sum")
    splits = (splits + [0.0, 0.0])[:3]
    total = sum(splits)
    splits = [s / total for s in splits]
    index = [0]
    for s in splits:
        index.append(index[-1] + int(round(s * float(size))))
    diff = index[-1] - size
    for i in range(1, len(index)):
        index[i] -= diff
    assert len(index) == 4 and index[-1] == size
    return index


def parse_data_prefix(data_prefix: Sequence[Any]) -> tuple[list[str], list[float]]:
    """Split `--data-path` into prefixes and normalised weights (one bare prefix gets weight 1)."""
    items = [str(x) for x in data_prefix]
    if len(items) == 1:
        return [items[0].strip()], [1.0]
    if len(items) % 2 != 0:
        raise ValueError(f"--data-path {' '.join(items)}: give one prefix, or pairs of weight and prefix "
                         "like '0.3 path/a_text_document 0.7 path/b_text_document'")
    prefixes, weights = [], []
    for i in range(0, len(items), 2):
        try:
            w = float(items[i])
        except ValueError as exc:
            raise ValueError(f"--data-path: expected a weight before {items[i + 1]!r}, got {items[i]!r}") from exc
        if w < 0 or not math.isfinite(w):
            raise ValueError(f"--data-path: weight {items[i]!r} for {items[i + 1]!r} must be a non-negative number")
        weights.append(w)
        prefixes.append(items[i + 1].strip())
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--data-path {' '.join(items)}: the weights must add up to a positive number")
    return prefixes, [w / total for w in weights]


def get_datasets_weights_and_num_samples(data_prefix: Sequence[Any], train_valid_test_num_samples: NumSamples
                                         ) -> tuple[list[str], list[float], list]:
    """Prefixes, normalised weights and per-dataset sample counts (share of the total, plus 0.5%, rounded up)."""
    prefixes, weights = parse_data_prefix(data_prefix)
    if isinstance(train_valid_test_num_samples, (list, tuple)):
        per_dataset = [[int(math.ceil(n * w * 1.005)) for n in train_valid_test_num_samples] for w in weights]
    else:
        per_dataset = [int(math.ceil(train_valid_test_num_samples * w * 1.005)) for w in weights]
    return prefixes, weights, per_dataset


def get_indexed_dataset_(data_prefix: str, data_impl: str, skip_warmup: bool):
    """Open the preprocessed `<prefix>.bin/.idx` pair with owner 2's reader, with Megatron's log lines."""
    print_rank_0(" > building dataset index ...")
    start = time.time()
    dataset = make_dataset(data_prefix, data_impl, skip_warmup)
    if dataset is None:
        raise ValueError(f"--data-path {data_prefix}: no indexed dataset found ({data_prefix}.bin / {data_prefix}.idx "
                         f"with --data-impl {data_impl}); run tools/preprocess_data.py first")
    print_rank_0(f" > finished creating indexed dataset in {time.time() - start:4f} seconds")
    print_rank_0(f"    number of documents: {dataset.sizes.shape[0]}")
    return dataset


def user_cache_dir() -> Path:
    """Fallback location for index caches when the data directory is read-only."""
    env = os.environ.get("MEGATRON_LITE_CACHE_DIR")
    if env:
        return Path(env) / "index-cache"
    home_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return home_cache / "megatron-lite" / "index-cache"


def index_cache_dirs(data_prefix: str, data_cache_path: Optional[str], *, for_search: bool = False) -> list[Path]:
    """Index-map cache directories for `data_prefix`: where to write (first writable one) or, with for_search,
    where to look. As Megatron, `<data dir>/index-cache` is searched before --data-cache-path (no duplicate
    caches), while new caches go to --data-cache-path when given; then a user cache dir and a temp dir."""
    default = Path(os.path.dirname(os.path.abspath(data_prefix))) / "index-cache"
    given = [Path(data_cache_path)] if data_cache_path else []
    dirs = [default, *given] if for_search else [*given, default]
    dirs.append(user_cache_dir())
    dirs.append(Path(tempfile.gettempdir()) / f"megatron-lite-{os.getuid()}" / "index-cache")
    return dirs


_CACHE_NOTES: set = set()


def first_writable_dir(dirs: Sequence[Path], data_cache_path: Optional[str] = None) -> Path:
    """The first of `dirs` this process can create and write into. When `data_cache_path` (--data-cache-path, the
    first of `dirs`) is not usable, one note says where the caches go instead."""
    for i, d in enumerate(dirs):
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK | os.X_OK):
            if data_cache_path and i > 0 and (data_cache_path, str(d)) not in _CACHE_NOTES:
                _CACHE_NOTES.add((data_cache_path, str(d)))  # once per folder, not once per split
                print(f" > note: --data-cache-path {data_cache_path} is not a writable folder; the dataset index "
                      f"cache goes to {d} instead", flush=True)
            return d
    raise RuntimeError(f"no writable directory for the dataset index cache (tried {', '.join(map(str, dirs))}); "
                       "pass --data-cache-path DIR with a directory you can write to")


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save to a temporary name in the same directory, then rename (readers never see partial files)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npy")
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def npy_problem(path: Path) -> Optional[str]:
    """None when `path` is a readable .npy whose size matches its header; otherwise what is wrong with it (an index
    cache file truncated or overwritten outside our atomic writes)."""
    try:
        np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError, EOFError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def usable_npy(path: Path, report: bool = False) -> bool:
    """A cached index file exists and is intact; with `report`, one warning line names a damaged one (it is then
    rebuilt by the caller)."""
    if not path.is_file():
        return False
    problem = npy_problem(path)
    if problem is not None and report:
        print(f" > WARNING: index cache file {path} is damaged ({problem}; truncated?): rebuilding it", flush=True)
    return problem is None


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# Sentence-level datasets (BERT, T5): errors, the samples mapping, segments, truncation and masking.

class DatasetError(MegatronUserError, ValueError):
    """Data that cannot give the samples asked for; the message names the file or flag and the fix."""


_DEFAULT_NUM_EPOCHS = int(np.iinfo(np.int32).max) - 1
_DEFAULT_MAX_NUM_SAMPLES = int(np.iinfo(np.int64).max) - 1


def samples_mapping_filename(data_prefix: str, name: str, num_epochs: Optional[int], max_num_samples: Optional[int],
                             max_seq_length: int, short_seq_prob: float, seed: int) -> str:
    """Megatron's cache name `{prefix}_{name}_indexmap[_{E}ep][_{N}mns]_{msl}msl_{ssp:.2f}ssp_{seed}s.npy`."""
    num_epochs = num_epochs or _DEFAULT_NUM_EPOCHS
    max_num_samples = max_num_samples or _DEFAULT_MAX_NUM_SAMPLES
    out = f"{data_prefix}_{name}_indexmap"
    if num_epochs != _DEFAULT_NUM_EPOCHS:
        out += f"_{num_epochs}ep"
    if max_num_samples != _DEFAULT_MAX_NUM_SAMPLES:
        out += f"_{max_num_samples}mns"
    return out + f"_{max_seq_length}msl_{short_seq_prob:0.2f}ssp_{seed}s.npy"


def build_samples_mapping(doc_idx: np.ndarray, sizes: np.ndarray, num_epochs: int, max_num_samples: int,
                          max_seq_length: int, short_seq_prob: float, seed: int, min_num_sent: int,
                          verbose: bool = False) -> np.ndarray:
    """Megatron's `helpers.build_mapping` (C++): shuffled rows (first sentence, end sentence, target length)."""
    return get_helpers().build_mapping(np.ascontiguousarray(doc_idx, dtype=np.int64),
                                       np.ascontiguousarray(sizes, dtype=np.int32), int(num_epochs),
                                       int(max_num_samples), int(max_seq_length), float(short_seq_prob), int(seed),
                                       bool(verbose), int(min_num_sent))


def _mapping_description(data_prefix: str, name: str, doc_idx: np.ndarray, min_num_sent: int) -> str:
    """What a cached mapping was built from beyond its file name (which Megatron does not make unique: the split
    and the binary head are not in it); stored beside the .npy and compared on load."""
    digest = hashlib.md5(np.ascontiguousarray(doc_idx, dtype=np.int64).tobytes()).hexdigest()
    return (f"BERT/T5 samples mapping\ndata prefix {os.path.basename(data_prefix)}\nsplit {name}\n"
            f"documents {len(doc_idx) - 1}\nsentences [{int(doc_idx[0])}, {int(doc_idx[-1])})\n"
            f"doc_idx md5 {digest}\nmin_num_sent {min_num_sent}\n")


def _mapping_locations(filename: str, data_cache_path: Optional[str]) -> tuple[list[Path], list[Path]]:
    """(where to look, where to write): Megatron's own path beside the data first, then --data-cache-path, then
    per-data-directory subfolders of the user / temp cache (for read-only data directories)."""
    megatron_path = Path(filename)
    base = megatron_path.name
    tag = hashlib.md5(str(megatron_path.parent.resolve()).encode()).hexdigest()[:12]
    given = [Path(data_cache_path) / base] if data_cache_path else []
    fallback = [user_cache_dir() / tag / base,
                Path(tempfile.gettempdir()) / f"megatron-lite-{os.getuid()}" / "index-cache" / tag / base]
    return [megatron_path, *given, *fallback], [*given, megatron_path, *fallback]


def _dsc_path(npy: Path) -> Path:
    return npy.with_name(npy.name[:-len(".npy")] + ".dsc")


def get_samples_mapping(indexed_dataset: Any, data_prefix: str, num_epochs: Optional[int],
                        max_num_samples: Optional[int], max_seq_length: int, short_seq_prob: float, seed: int,
                        name: str, binary_head: bool, *, data_cache_path: Optional[str] = None, group: Any = None,
                        synchronize: bool = True) -> np.ndarray:
    """Load, or build on the group's first rank while the others wait, the samples mapping of the split whose
    documents `indexed_dataset.doc_idx` currently lists; returned memory-mapped. As Megatron: min_num_sent is 2 with
    the binary head, else 1; no epoch count means "until max_num_samples" (checked once per epoch).

    Megatron's file name leaves out the split and the binary head, so a stale file would be reused silently; here a
    `.dsc` beside it records what it was built from and a mismatch is rebuilt (files without one, as Megatron
    writes them, are used as they are)."""
    if not num_epochs and not max_num_samples:
        raise ValueError("get_samples_mapping: give num_epochs or max_num_samples")
    epochs = int(num_epochs or _DEFAULT_NUM_EPOCHS)
    samples = int(max_num_samples or _DEFAULT_MAX_NUM_SAMPLES)
    min_num_sent = 2 if binary_head else 1
    filename = samples_mapping_filename(data_prefix, name, num_epochs, max_num_samples, max_seq_length,
                                        short_seq_prob, seed)
    doc_idx = np.asarray(indexed_dataset.doc_idx)
    desc = _mapping_description(data_prefix, name, doc_idx, min_num_sent)
    search, write = _mapping_locations(filename, data_cache_path)

    def find(report: bool = False) -> Optional[Path]:
        for path in search:
            if usable_npy(path, report):
                dsc = _dsc_path(path)
                if dsc.is_file() and dsc.read_text() != desc:  # same name, other split or binary head: stale
                    if report:
                        print(f" > WARNING: {path} was built from other data, another --split or another "
                              "binary-head setting; rebuilding it", flush=True)
                    continue
                return path
        return None

    def build() -> None:
        out_dir = first_writable_dir([p.parent for p in write], data_cache_path=data_cache_path)
        out = out_dir / Path(filename).name
        with file_lock(out_dir / f".{out.name}.lock"):
            if find(report=True) is not None:
                return
            print(f" > WARNING: could not find index map file {out}, building the indices on rank 0 ...", flush=True)
            start = time.time()
            print(f" > building samples index mapping for {name} ...", flush=True)
            mapping = build_samples_mapping(doc_idx, indexed_dataset.sizes, epochs, samples, max_seq_length,
                                            short_seq_prob, seed, min_num_sent, verbose=True)
            print(" > done building samples index maping", flush=True)
            save_npy_atomic(out, mapping)
            write_text_atomic(_dsc_path(out), desc)  # after the .npy: a reader never pairs a new .dsc with an old map
            print(f" > saved the index mapping in {out}", flush=True)
            print(f" > elasped time to build and save samples mapping (seconds): {time.time() - start:4f}",
                  flush=True)

    error: Optional[BaseException] = None
    if synchronize:
        try:
            if find() is None and is_group_leader(group):
                build()
        except BaseException as exc:  # noqa: BLE001 - reach the barrier first so other ranks do not hang
            error = exc
        barrier(group)
        if error is not None:
            raise error
    path = find()
    if path is None:  # not visible here (node-local disk) or synchronize=False: the build is deterministic
        build()
        path = find()
        if path is None:
            raise RuntimeError(f"samples mapping {Path(filename).name} was built but cannot be found")
    print_rank_0(f" > loading indexed mapping from {path}")
    start = time.time()
    mapping = np.load(path, allow_pickle=False, mmap_mode="r")
    print_rank_0(f"    loaded indexed file in {time.time() - start:3.3f} seconds")
    print_rank_0(f"    total number of samples: {mapping.shape[0]}")
    return mapping


def check_sentence_pairs(doc_idx: np.ndarray, data_prefix: str, name: str) -> None:
    """With BERT's binary head every sample needs two sentences: refuse data where no document has two (such as
    document-level `_text_document` files, on which Megatron silently builds zero samples)."""
    doc_idx = np.asarray(doc_idx)
    if len(doc_idx) < 2 or int(np.max(np.diff(doc_idx))) < 2:
        raise DatasetError(
            f"--data-path {data_prefix} ({name} split): no document has two or more sentences, so BERT's binary head "
            "gets no samples; preprocess with tools/preprocess_data.py --split-sentences (and use the "
            "_text_sentence prefix), or pass --bert-no-binary-head")


def check_no_empty_sentences(indexed_dataset: Any, data_prefix: str, name: str) -> None:
    """BERT's segments are made of whole sentences: a zero-length sentence can leave segment A empty (Megatron's
    bare `assert len_a > 0` at some sample). One line naming the file, the document and the fix, before any sample."""
    doc_idx = np.asarray(indexed_dataset.doc_idx, dtype=np.int64)
    if len(doc_idx) < 2:
        return
    sizes = np.asarray(indexed_dataset.sizes)[doc_idx[0]:doc_idx[-1]]
    empty = np.flatnonzero(sizes == 0)
    if len(empty) == 0:
        return
    sentence = int(doc_idx[0] + empty[0])
    document = int(np.searchsorted(doc_idx, sentence, side="right") - 1)
    raise DatasetError(f"--data-path {data_prefix} ({name} split): {len(empty)} sentence(s) hold no tokens, the first "
                       f"in document {document} of the split (sentence {sentence} of {data_prefix}.bin); BERT samples "
                       "need non-empty sentences: preprocess again with tools/preprocess_data.py --split-sentences "
                       "(it drops empty sentences)")


def tokenizer_special_ids(tokenizer: Any, names: Sequence[str], model: str) -> list[int]:
    """The tokenizer's special ids `names` (cls, sep, mask, pad, bos, eos), or a one-line error naming the flag."""
    ids = []
    for name in names:
        try:
            ids.append(int(getattr(tokenizer, name)))
        except (AttributeError, NotImplementedError, TypeError):
            raise DatasetError(f"{model} needs a tokenizer with a {name} token, which the "
                               f"{getattr(tokenizer, 'name', type(tokenizer).__name__)} tokenizer lacks; use "
                               "--tokenizer-type BertWordPieceLowerCase (or BertWordPieceCase, SentencePieceTokenizer)"
                               ) from None
    return ids


def get_a_and_b_segments(sample: Sequence[Sequence[int]], np_rng: np.random.RandomState
                         ) -> tuple[list, list, bool]:
    """Split the sentences into segments A and B at a random point; swap them with probability 0.5 (sentence-order
    prediction: is_next_random True means swapped)."""
    n_sentences = len(sample)
    assert n_sentences > 1, "make sure each sample has at least two sentences."
    a_end = 1
    if n_sentences >= 3:
        a_end = np_rng.randint(1, n_sentences)  # exclusive upper bound
    tokens_a = [t for sentence in sample[:a_end] for t in sentence]
    tokens_b = [t for sentence in sample[a_end:] for t in sentence]
    is_next_random = False
    if np_rng.random() < 0.5:
        is_next_random = True
        tokens_a, tokens_b = tokens_b, tokens_a
    return tokens_a, tokens_b, is_next_random


def truncate_segments(tokens_a: list, tokens_b: list, len_a: int, len_b: int, max_num_tokens: int,
                      np_rng: np.random.RandomState) -> bool:
    """Trim the longer segment one token at a time (front or back at random) until both fit; True if trimmed."""
    assert len_a > 0
    if len_a + len_b <= max_num_tokens:
        return False
    while len_a + len_b > max_num_tokens:
        if len_a > len_b:
            len_a -= 1
            tokens = tokens_a
        else:
            len_b -= 1
            tokens = tokens_b
        if np_rng.random() < 0.5:
            del tokens[0]
        else:
            tokens.pop()
    return True


def create_tokens_and_tokentypes(tokens_a: list, tokens_b: list, cls_id: int, sep_id: int
                                 ) -> tuple[list, list]:
    """[CLS] A [SEP] (types 0) then, when B is non-empty, B [SEP] (types 1)."""
    tokens = [cls_id, *tokens_a, sep_id]
    tokentypes = [0] * len(tokens)
    if tokens_b:
        tokens += [*tokens_b, sep_id]
        tokentypes += [1] * (len(tokens_b) + 1)
    return tokens, tokentypes


class MaskedLmInstance(NamedTuple):
    index: Any  # a position (masked_lms) or a list of positions (masked_spans)
    label: Any  # the original token id, or the list of original ids of a span


def is_start_piece(piece: str) -> bool:
    """A WordPiece that does not continue the previous word (continuations start with `##`)."""
    return not piece.startswith("##")


def create_masked_lm_predictions(tokens: list, vocab_id_list: Sequence[int], vocab_id_to_token_dict: dict,
                                 masked_lm_prob: float, cls_id: int, sep_id: int, mask_id: int,
                                 max_predictions_per_seq: float, np_rng: np.random.RandomState,
                                 max_ngrams: int = 3, do_whole_word_mask: bool = True,
                                 favor_longer_ngram: bool = False, geometric_dist: bool = False,
                                 masking_style: str = "bert") -> tuple:
    """Megatron's masked-LM selection with its exact order of random draws.

    Candidates are whole words (a `##` piece joins the previous word) except [CLS]/[SEP]. The candidate list is
    shuffled; for each candidate start an n-gram size is drawn (p ~ 1/n up to max_ngrams, or min(Geometric(0.2),
    max_ngrams) with geometric_dist), shrunk until it fits the budget `min(max_predictions_per_seq,
    max(1, round(len(tokens) * masked_lm_prob)))`, and skipped if it overlaps earlier picks. "bert" style replaces a
    picked token by [MASK] 80%, keeps it 10%, a random vocab id 10%; "t5" style always uses mask_id. The candidate
    list is shuffled once more at the end (Megatron's permutation step is off by default but still consumes those
    draws). Returns (tokens, positions, labels, token_boundary, spans), positions and spans in order.
    (Megatron's do_permutation option is not offered: its branch draws from the global numpy RNG.)
    """
    # port of Megatron's create_masked_lm_predictions
    if masking_style not in ("bert", "t5"):
        raise ValueError(f"invalid masking style {masking_style!r}")
    cand_indexes: list[list[int]] = []
    token_boundary = [0] * len(tokens)
    for i, token in enumerate(tokens):
        if token == cls_id or token == sep_id:
            token_boundary[i] = 1
            continue
        start_piece = is_start_piece(vocab_id_to_token_dict[token])
        if do_whole_word_mask and cand_indexes and not start_piece:
            cand_indexes[-1].append(i)
        else:
            cand_indexes.append([i])
            if start_piece:
                token_boundary[i] = 1

    output_tokens = list(tokens)
    if masked_lm_prob == 0:
        return output_tokens, [], [], token_boundary, []
    num_to_predict = min(max_predictions_per_seq, max(1, int(round(len(tokens) * masked_lm_prob))))

    ngrams = np.arange(1, max_ngrams + 1, dtype=np.int64)
    pvals = 1.0 / np.arange(1, max_ngrams + 1)
    pvals /= pvals.sum(keepdims=True)
    if favor_longer_ngram:
        pvals = pvals[::-1]
    # np_rng.choice(ngrams, p=...) with RandomState's frozen (legacy) stream is one random_sample() looked up in
    # cdf = p.cumsum() / its last value (side="right"); doing that lookup here saves choice()'s per-call checks.
    cdf = (pvals / pvals.sum(keepdims=True)).cumsum()
    cdf /= cdf[-1]
    cdf_list = cdf.tolist()
    # Megatron shuffles a list holding, for every candidate start, its 1..max_ngrams-gram lists; shuffling the
    # start positions instead draws the same numbers and gives the same order.
    order = list(range(len(cand_indexes)))
    np_rng.shuffle(order)

    masked_lms: list[MaskedLmInstance] = []
    masked_spans: list[MaskedLmInstance] = []
    covered: set[int] = set()
    for start in order:
        if len(masked_lms) >= num_to_predict:
            break
        if not geometric_dist:
            # every entry has max_ngrams n-gram lists (shorter ones near the end repeat), so all sizes are allowed
            n = int(ngrams[bisect.bisect_right(cdf_list, np_rng.random_sample())])
        else:
            n = min(int(np_rng.geometric(0.2)), max_ngrams)
        index_set = [i for word in cand_indexes[start:start + n] for i in word]
        n -= 1
        while len(masked_lms) + len(index_set) > num_to_predict:  # try shorter n-grams
            if n == 0:
                break
            index_set = [i for word in cand_indexes[start:start + n] for i in word]
            n -= 1
        if len(masked_lms) + len(index_set) > num_to_predict:
            continue
        if any(i in covered for i in index_set):
            continue
        for index in index_set:
            covered.add(index)
            if masking_style == "bert":
                if np_rng.random() < 0.8:
                    masked_token = mask_id
                elif np_rng.random() < 0.5:
                    masked_token = tokens[index]
                else:
                    masked_token = vocab_id_list[np_rng.randint(0, len(vocab_id_list))]
            else:
                masked_token = mask_id
            output_tokens[index] = masked_token
            masked_lms.append(MaskedLmInstance(index=index, label=tokens[index]))
        masked_spans.append(MaskedLmInstance(index=index_set, label=[tokens[i] for i in index_set]))
    assert len(masked_lms) <= num_to_predict
    np_rng.shuffle(order)  # Megatron's second shuffle (permutation step), kept for its draws

    masked_lms.sort(key=lambda x: x.index)
    masked_spans.sort(key=lambda x: x.index[0])
    positions = [p.index for p in masked_lms]
    labels = [p.label for p in masked_lms]
    return output_tokens, positions, labels, token_boundary, masked_spans
