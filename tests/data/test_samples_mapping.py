"""BERT/T5 samples mapping: the C++ `build_mapping` equals a slow pure-Python reference of Megatron's algorithm
(std::mt19937 / std::mt19937_64 reproduced here), and `get_samples_mapping` caches it under Megatron's file name,
built once on the first rank while the others wait, and memory-mapped."""
from __future__ import annotations

import os

import numpy as np
import pytest

from megatron.data import dataset_utils
from megatron.data.dataset_utils import (
    build_samples_mapping,
    get_samples_mapping,
    samples_mapping_filename,
)
from megatron.data.helpers import get_helpers
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, make_dataset
from tests.dist_utils import run_distributed


class MersenneTwister:
    """std::mt19937 (w=32) and std::mt19937_64 (w=64) as the C++ standard defines them ([rand.eng.mers])."""

    def __init__(self, seed: int, bits: int = 32) -> None:
        if bits == 32:
            (self.w, self.n, self.m, self.r, self.a, self.u, self.d, self.s, self.b, self.t, self.c, self.l,
             self.f) = (32, 624, 397, 31, 0x9908B0DF, 11, 0xFFFFFFFF, 7, 0x9D2C5680, 15, 0xEFC60000, 18, 1812433253)
        else:
            (self.w, self.n, self.m, self.r, self.a, self.u, self.d, self.s, self.b, self.t, self.c, self.l,
             self.f) = (64, 312, 156, 31, 0xB5026F5AA96619E9, 29, 0x5555555555555555, 17, 0x71D67FFFEDA60000, 37,
                        0xFFF7EEE000000000, 43, 6364136223846793005)
        self.mask = (1 << self.w) - 1
        self.lower = (1 << self.r) - 1
        self.upper = self.mask & ~self.lower
        x = [seed & self.mask]
        for i in range(1, self.n):
            x.append((self.f * (x[-1] ^ (x[-1] >> (self.w - 2))) + i) & self.mask)
        self.x = x
        self.i = self.n

    def _twist(self) -> None:
        x, n, m = self.x, self.n, self.m
        for k in range(n):
            y = (x[k] & self.upper) | (x[(k + 1) % n] & self.lower)
            x[k] = x[(k + m) % n] ^ (y >> 1) ^ (self.a if y & 1 else 0)
        self.i = 0

    def __call__(self) -> int:
        if self.i >= self.n:
            self._twist()
        y = self.x[self.i]
        self.i += 1
        y ^= (y >> self.u) & self.d
        y ^= (y << self.s) & self.b
        y ^= (y << self.t) & self.c
        y ^= y >> self.l
        return y & self.mask


def reference_build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed,
                            min_num_sent):
    """Megatron's build_mapping, written out plainly (megatron-facts §2.6, wave2 §1.1)."""
    ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    gen = MersenneTwister(seed)

    def target_len():
        if ratio == 0:
            return max_seq_length
        r = gen()
        return 2 + r % (max_seq_length - 1) if r % ratio == 0 else max_seq_length

    rows = []
    for _epoch in range(num_epochs):
        if len(rows) >= max_num_samples:
            break
        for d in range(len(docs) - 1):
            first, last = int(docs[d]), int(docs[d + 1])
            n = last - first
            if n < min_num_sent or (n > 1 and any(int(sizes[s]) > 512 for s in range(first, last))):
                continue
            start, seq_len, num_sent, target = first, 0, 0, target_len()
            for s in range(first, last):
                seq_len += int(sizes[s])
                num_sent += 1
                remaining = last - s - 1
                if (seq_len >= target and remaining > 1 and num_sent >= min_num_sent) or remaining == 0:
                    rows.append([start, s + 1, target])
                    start, seq_len, num_sent, target = s + 1, 0, 0, target_len()
    gen64 = MersenneTwister(seed + 1, bits=64)
    for i in range(len(rows) - 1, 0, -1):
        j = gen64() % (i + 1)
        rows[i], rows[j] = rows[j], rows[i]
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def test_mersenne_twister_matches_the_cpp_standard():
    # [rand.predef]: the 10000th consecutive invocation of a default-constructed engine (seed 5489)
    gen = MersenneTwister(5489)
    for _ in range(9999):
        gen()
    assert gen() == 4123659995
    gen64 = MersenneTwister(5489, bits=64)
    for _ in range(9999):
        gen64()
    assert gen64() == 9981545732273789042


def _random_corpus(rng: np.random.Generator, num_docs: int):
    counts = rng.integers(0, 7, size=num_docs)
    docs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    sizes = rng.integers(1, 60, size=int(docs[-1])).astype(np.int32)
    long = rng.random(len(sizes)) < 0.02
    sizes[long] = rng.integers(500, 600, size=int(long.sum()))  # some > LONG_SENTENCE_LEN, some not
    return docs, sizes


def test_build_mapping_matches_reference_on_random_inputs():
    rng = np.random.default_rng(2024)
    helpers = get_helpers()
    total_rows = 0
    for trial in range(60):
        docs, sizes = _random_corpus(rng, int(rng.integers(1, 30)))
        if trial % 5 == 0:  # a split: doc_idx slice with absolute sentence indices
            docs = docs[int(rng.integers(0, len(docs) // 2 + 1)):]
        num_epochs = int(rng.integers(1, 4))
        max_num_samples = int(rng.integers(1, 80))
        max_seq_length = int(rng.integers(2, 130))
        short_seq_prob = float(rng.choice([0.0, 0.1, 0.33, 0.5, 1.0]))
        seed = int(rng.integers(0, 2**31 - 2))
        min_num_sent = int(rng.integers(1, 3))
        got = helpers.build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed,
                                    False, min_num_sent)
        want = reference_build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob,
                                       seed, min_num_sent)
        assert got.dtype == np.uint32 and got.shape[1] == 3
        np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"trial {trial}")
        total_rows += len(want)
    assert total_rows > 500  # the cases really produce samples


def test_build_mapping_properties():
    rng = np.random.default_rng(5)
    docs, sizes = _random_corpus(rng, 200)
    sizes = np.minimum(sizes, 100).astype(np.int32)
    m = build_samples_mapping(docs, sizes, 1, 10**9, 125, 0.1, 1234, 2).astype(np.int64)
    first, end, target = m[:, 0], m[:, 1], m[:, 2]
    assert np.all(end - first >= 2)  # the binary head always gets two sentences
    assert np.all((target >= 2) & (target <= 125))
    short = np.mean(target < 125)
    assert 0.03 < short < 0.2, short  # --short-seq-prob 0.1
    # every sentence of a usable document is covered exactly once per epoch
    covered = np.zeros(len(sizes), dtype=np.int64)
    for a, b in zip(first, end):
        covered[a:b] += 1
    counts = np.diff(docs)
    usable = [d for d in range(len(counts)) if counts[d] >= 2]
    for d in usable:
        assert np.all(covered[docs[d]:docs[d + 1]] == 1)
    # the per-epoch stop: asking for fewer samples still completes the epoch, more starts another one
    one_epoch = len(m)
    assert len(build_samples_mapping(docs, sizes, 5, 1, 125, 0.1, 1234, 2)) == one_epoch
    two = len(build_samples_mapping(docs, sizes, 5, one_epoch + 1, 125, 0.1, 1234, 2))
    assert 1.8 * one_epoch < two < 2.2 * one_epoch  # the second epoch draws other target lengths
    # document-level data with min_num_sent 2 gives nothing, and stops instead of running INT32_MAX epochs
    doc_level = np.arange(len(sizes) + 1, dtype=np.int64)
    assert len(build_samples_mapping(doc_level, sizes, 2**31 - 2, 2**62, 125, 0.1, 1, 2)) == 0
    assert len(build_samples_mapping(doc_level, sizes, 1, 2**62, 125, 0.1, 1, 1)) == len(sizes)


def test_build_mapping_rejects_bad_input():
    helpers = get_helpers()
    docs = np.array([0, 2], dtype=np.int64)
    sizes = np.array([3, 4], dtype=np.int32)
    with pytest.raises(TypeError, match="docs must be a numpy array of dtype int64"):
        helpers.build_mapping(docs.astype(np.int32), sizes, 1, 10, 10, 0.1, 1, False, 2)
    with pytest.raises(ValueError, match="within"):
        helpers.build_mapping(np.array([0, 5], dtype=np.int64), sizes, 1, 10, 10, 0.1, 1, False, 2)
    with pytest.raises(ValueError, match="short_seq_prob"):
        helpers.build_mapping(docs, sizes, 1, 10, 10, 1.5, 1, False, 2)


def write_sentences(prefix, docs: list) -> None:
    """A sentence-level .bin/.idx: `docs` is a list of documents, each a list of sentences (lists of ids)."""
    builder = MMapIndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for doc in docs:
        for sentence in doc:
            builder.add_item(np.array(sentence, dtype=np.uint16))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def _corpus(tmp_path, num_docs=30, seed=0):
    rng = np.random.default_rng(seed)
    docs = [[list(rng.integers(5, 100, size=int(rng.integers(3, 20)))) for _ in range(int(rng.integers(1, 6)))]
            for _ in range(num_docs)]
    prefix = tmp_path / "c_text_sentence"
    write_sentences(prefix, docs)
    return str(prefix), make_dataset(str(prefix), "mmap", True)


def test_filename_matches_megatron():
    name = samples_mapping_filename("/d/x_text_sentence", "train", None, 128000, 509, 0.1, 1234)
    assert name == "/d/x_text_sentence_train_indexmap_128000mns_509msl_0.10ssp_1234s.npy"
    assert samples_mapping_filename("p", "valid", 3, None, 62, 0.05, 7) == "p_valid_indexmap_3ep_62msl_0.05ssp_7s.npy"


def test_get_samples_mapping_caches_and_checks_what_it_was_built_from(tmp_path, capsys):
    prefix, ds = _corpus(tmp_path)
    m = get_samples_mapping(ds, prefix, None, 40, 61, 0.1, 1234, "train", True)
    path = tmp_path / "c_text_sentence_train_indexmap_40mns_61msl_0.10ssp_1234s.npy"
    assert path.is_file() and isinstance(m, np.memmap)
    want = build_samples_mapping(ds.doc_idx, ds.sizes, 2**31 - 2, 40, 61, 0.1, 1234, 2)
    np.testing.assert_array_equal(m, want)
    assert "building the indices on rank 0" in capsys.readouterr().out
    mtime = os.path.getmtime(path)
    m2 = get_samples_mapping(ds, prefix, None, 40, 61, 0.1, 1234, "train", True)
    np.testing.assert_array_equal(m2, want)
    assert os.path.getmtime(path) == mtime and "building" not in capsys.readouterr().out
    # the same file name for another split or without the binary head: rebuilt, not silently reused
    full = ds.get_doc_idx()
    ds.set_doc_idx(full[:11])
    try:
        m3 = get_samples_mapping(ds, prefix, None, 40, 61, 0.1, 1234, "train", True)
        np.testing.assert_array_equal(m3, build_samples_mapping(full[:11], ds.sizes, 2**31 - 2, 40, 61, 0.1, 1234, 2))
    finally:
        ds.set_doc_idx(full)
    assert "another --split" in capsys.readouterr().out
    m4 = get_samples_mapping(ds, prefix, None, 40, 61, 0.1, 1234, "train", False)
    np.testing.assert_array_equal(m4, build_samples_mapping(full, ds.sizes, 2**31 - 2, 40, 61, 0.1, 1234, 1))
    assert not np.array_equal(m4, want)
    # a Megatron-built cache (no .dsc) is taken as is
    os.unlink(path.with_suffix(".dsc"))
    np.testing.assert_array_equal(get_samples_mapping(ds, prefix, None, 40, 61, 0.1, 1234, "train", True), m4)


def test_get_samples_mapping_read_only_data_dir_and_cache_path(tmp_path, monkeypatch):
    prefix, ds = _corpus(tmp_path)
    cache = tmp_path / "cache"
    m = get_samples_mapping(ds, prefix, None, 10, 30, 0.1, 5, "valid", True, data_cache_path=str(cache))
    assert (cache / "c_text_sentence_valid_indexmap_10mns_30msl_0.10ssp_5s.npy").is_file()
    assert len(m) >= 10
    monkeypatch.setenv("MEGATRON_LITE_CACHE_DIR", str(tmp_path / "user"))
    real = dataset_utils.first_writable_dir
    monkeypatch.setattr(dataset_utils, "first_writable_dir",  # the data directory is read-only
                        lambda dirs, **kw: real([d for d in dirs if d != tmp_path], **kw))
    m = get_samples_mapping(ds, prefix, None, 10, 30, 0.1, 6, "valid", True)
    assert not (tmp_path / "c_text_sentence_valid_indexmap_10mns_30msl_0.10ssp_6s.npy").exists()
    found = list((tmp_path / "user").rglob("c_text_sentence_valid_indexmap_10mns_30msl_0.10ssp_6s.npy"))
    assert len(found) == 1 and len(m) >= 10


def _mapping_worker(rank, world, prefix):
    import torch.distributed as dist

    calls = []
    real = dataset_utils.build_samples_mapping

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dataset_utils.build_samples_mapping = counting
    ds = make_dataset(prefix, "mmap", True)
    m = get_samples_mapping(ds, prefix, None, 25, 40, 0.1, 99, "train", True)
    counts = [None] * world
    dist.all_gather_object(counts, (len(calls), np.asarray(m).tolist()))
    # without collectives (callers on a subset of ranks): the file lock lets one process build, the other loads
    calls.clear()
    m = get_samples_mapping(ds, prefix, None, 25, 40, 0.1, 99, "valid", True, synchronize=False)
    unsynced = [None] * world
    dist.all_gather_object(unsynced, (len(calls), np.asarray(m).tolist()))
    return counts, unsynced


def test_get_samples_mapping_built_once_under_gloo(tmp_path):
    prefix, _ = _corpus(tmp_path, seed=3)
    results = run_distributed(_mapping_worker, 2, args=(prefix,))
    per_rank, unsynced = results[0]
    assert [c for c, _ in per_rank] == [1, 0]  # rank 0 builds, the others wait and load
    assert all(rows == per_rank[0][1] for _, rows in per_rank)
    assert sum(c for c, _ in unsynced) == 1 and unsynced[0][1] == unsynced[1][1] == per_rank[0][1]
