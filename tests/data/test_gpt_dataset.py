"""GPT dataset index mappings, splits, caching, blending, samplers and multi-rank building."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.data import gpt_dataset
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)
from megatron.data.dataset_utils import get_datasets_weights_and_num_samples, get_train_valid_test_split_
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, make_dataset
from tests.dist_utils import run_distributed


def make_corpus(prefix: Path, num_docs: int, seed: int, max_len: int = 40, zero_docs: bool = False) -> list:
    """Write a tiny mmap dataset of random documents; return the documents."""
    rng = np.random.default_rng(seed)
    docs = []
    builder = MMapIndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for i in range(num_docs):
        n = 0 if zero_docs and i % 7 == 3 else int(rng.integers(1, max_len))
        doc = rng.integers(0, 1000, size=n).astype(np.uint16)
        builder.add_item(doc)
        builder.end_document()
        docs.append(doc.astype(np.int64))
    builder.finalize(str(prefix) + ".idx")
    return docs


def reference_samples(ds, docs: list) -> list:
    """Megatron's definition: concatenate the docs in doc_idx order; sample j is stream[j*s : j*s + s + 1]."""
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    s = ds.seq_length
    return [stream[int(j) * s: int(j) * s + s + 1] for j in ds.shuffle_idx]


def megatron_doc_idx(documents: np.ndarray, num_epochs: int, seed: int, separate_last: bool) -> np.ndarray:
    rng = np.random.RandomState(seed)
    if not separate_last:
        out = np.tile(documents, num_epochs).astype(np.int32)
        rng.shuffle(out)
        return out
    first = np.tile(documents, num_epochs - 1).astype(np.int32)
    rng.shuffle(first)
    last = documents.astype(np.int32).copy()
    rng.shuffle(last)
    return np.concatenate([first, last])


@pytest.fixture()
def corpus(tmp_path):
    prefix = tmp_path / "data" / "corpus_text_document"
    prefix.parent.mkdir()
    docs = make_corpus(prefix, num_docs=60, seed=0, zero_docs=True)
    return str(prefix), docs


def test_split_boundaries():
    assert get_train_valid_test_split_("969,30,1", 1000) == [0, 969, 999, 1000]
    assert get_train_valid_test_split_("969/30/1", 1000) == [0, 969, 999, 1000]
    assert get_train_valid_test_split_("100,0,0", 10) == [0, 10, 10, 10]
    assert get_train_valid_test_split_("1", 7) == [0, 7, 7, 7]
    assert get_train_valid_test_split_("1,1,1", 10) == [0, 4, 7, 10]  # Megatron's rounding correction
    assert get_train_valid_test_split_("8,2", 5) == [0, 4, 5, 5]
    with pytest.raises(ValueError, match="--split 'a,b'"):
        get_train_valid_test_split_("a,b", 10)
    with pytest.raises(ValueError, match="positive sum"):
        get_train_valid_test_split_("0,0,0", 10)


def test_weights_and_num_samples():
    prefixes, weights, nums = get_datasets_weights_and_num_samples(["1", "a", "3", "b"], [1000, 100, 10])
    assert prefixes == ["a", "b"] and weights == [0.25, 0.75]
    assert nums == [[math.ceil(250 * 1.005), math.ceil(25 * 1.005), math.ceil(2.5 * 1.005)],
                    [math.ceil(750 * 1.005), math.ceil(75 * 1.005), math.ceil(7.5 * 1.005)]]
    with pytest.raises(ValueError, match="pairs of weight and prefix"):
        get_datasets_weights_and_num_samples(["1", "a", "b"], [1, 1, 1])
    with pytest.raises(ValueError, match="expected a weight before 'b'"):
        get_datasets_weights_and_num_samples(["a", "b"], [1, 1, 1])


@pytest.mark.parametrize("num_train,seq", [(50, 16), (300, 7), (5, 64)])
def test_samples_match_reference(corpus, tmp_path, num_train, seq):
    prefix, docs = corpus
    train, valid, test = build_train_valid_test_datasets([prefix], "mmap", "80,10,10", [num_train, 20, 5], seq, 1234,
                                                         True, data_cache_path=str(tmp_path / "cache"))
    splits = get_train_valid_test_split_("80,10,10", len(docs))
    for ds, lo, hi in ((train, splits[0], splits[1]), (valid, splits[1], splits[2]), (test, splits[2], splits[3])):
        assert len(ds) >= ds.shuffle_idx.shape[0] and len(ds) == ds.sample_idx.shape[0] - 1
        # doc_idx holds whole epochs of exactly this split's documents
        epochs = len(ds.doc_idx) // (hi - lo)
        assert len(ds.doc_idx) == epochs * (hi - lo)
        np.testing.assert_array_equal(np.sort(ds.doc_idx), np.repeat(np.arange(lo, hi), epochs))
        assert sorted(ds.shuffle_idx.tolist()) == list(range(len(ds)))
        ref = reference_samples(ds, docs)
        for i in range(len(ds)):
            sample = ds[i]["text"]
            assert sample.dtype == np.int64 and sample.shape == (seq + 1,)
            np.testing.assert_array_equal(sample, ref[i])
    assert len(train) >= num_train and len(valid) >= 20 and len(test) >= 5


def test_doc_idx_and_last_epoch_rule(corpus, tmp_path):
    prefix, docs = corpus
    indexed = make_dataset(prefix, "mmap", True)
    documents = np.arange(0, 40, dtype=np.int32)
    tokens = int(indexed.sizes[documents].sum())
    seq = 10
    per_epoch = (tokens - 1) // seq
    # 2 epochs with a small last epoch -> separate shuffle of the last epoch
    small = per_epoch + 3
    ds = gpt_dataset.GPTDataset("train", prefix, documents, indexed, "x", small, seq, 5,
                                data_cache_path=str(tmp_path / "c1"))
    np.testing.assert_array_equal(ds.doc_idx, megatron_doc_idx(documents, 2, 5, separate_last=True))
    first_epochs_samples = (tokens - 1) // seq
    assert ds.shuffle_idx[:first_epochs_samples].max() < first_epochs_samples
    assert ds.shuffle_idx[first_epochs_samples:].min() >= first_epochs_samples
    # 2 epochs, last one mostly used -> one global shuffle
    big = 2 * per_epoch - 1
    ds2 = gpt_dataset.GPTDataset("train", prefix, documents, indexed, "x", big, seq, 5,
                                 data_cache_path=str(tmp_path / "c2"))
    np.testing.assert_array_equal(ds2.doc_idx, megatron_doc_idx(documents, 2, 5, separate_last=False))
    ref = reference_samples(ds2, docs)
    np.testing.assert_array_equal(ds2[len(ds2) - 1]["text"], ref[-1])


def test_cache_reuse_and_keys(corpus, tmp_path, monkeypatch, capsys):
    prefix, _ = corpus
    cache = tmp_path / "cache"
    args = ([prefix], "mmap", "100,0,0", [40, 0, 0], 16, 1, True)
    first = build_train_valid_test_datasets(*args, data_cache_path=str(cache))[0]
    assert "building the indices" in capsys.readouterr().out
    files = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
    assert len(files) == 4 and sum(f.endswith(".dsc") for f in files) == 1
    mtimes = {p: p.stat().st_mtime_ns for p in cache.iterdir()}

    def fail(*a, **k):
        raise AssertionError("rebuilt although the cache exists")

    monkeypatch.setattr(gpt_dataset, "_build_arrays_into", fail)
    second = build_train_valid_test_datasets(*args, data_cache_path=str(cache))[0]
    assert "building the indices" not in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert isinstance(second.sample_idx, np.memmap)
    np.testing.assert_array_equal(first[3]["text"], second[3]["text"])
    monkeypatch.undo()
    build_train_valid_test_datasets([prefix], "mmap", "100,0,0", [40, 0, 0], 16, 2, True, data_cache_path=str(cache))
    build_train_valid_test_datasets([prefix], "mmap", "100,0,0", [40, 0, 0], 8, 1, True, data_cache_path=str(cache))
    assert len(list(cache.glob("*.dsc"))) == 3


def test_default_cache_next_to_data(corpus):
    prefix, _ = corpus
    train, valid, test = build_train_valid_test_datasets([prefix], "mmap", "100,0,0", [10, 0, 0], 8, 1, True)
    assert valid is None and test is None
    cache = Path(prefix).parent / "index-cache"
    assert len(list(cache.glob("*_sample_idx.npy"))) == 1 and len(train) >= 10
    # as Megatron, a cache next to the data is found before --data-cache-path (no duplicate build)
    other = Path(prefix).parent.parent / "elsewhere"
    again = build_train_valid_test_datasets([prefix], "mmap", "100,0,0", [10, 0, 0], 8, 1, True,
                                            data_cache_path=str(other))[0]
    assert not other.exists() or not list(other.glob("*.npy"))
    np.testing.assert_array_equal(again[0]["text"], train[0]["text"])


def test_blending(tmp_path):
    prefixes, docs = [], []
    for k in range(2):
        p = tmp_path / f"part{k}"
        docs.append(make_corpus(p, num_docs=30, seed=10 + k))
        prefixes.append(str(p))
    num = [400, 30, 0]
    train, valid, test = build_train_valid_test_datasets(["0.3", prefixes[0], "0.7", prefixes[1]], "mmap", "90,10,0",
                                                         num, 12, 3, True, data_cache_path=str(tmp_path / "c"))
    assert isinstance(train, BlendableDataset) and len(train) == 400 and len(valid) == 30 and test is None
    counts = np.bincount(train.dataset_index, minlength=2) / len(train)
    np.testing.assert_allclose(counts, [0.3, 0.7], atol=0.01)
    for comp, n in zip(train.datasets, (math.ceil(400 * 0.3 * 1.005), math.ceil(400 * 0.7 * 1.005))):
        assert len(comp) >= n
    for i in (0, 1, 57, 399):
        d, j = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        np.testing.assert_array_equal(train[i]["text"], train.datasets[d][j]["text"])
    with pytest.raises(IndexError):
        train[400]


def test_separate_split_prefixes(tmp_path):
    paths = []
    for k in range(3):
        make_corpus(tmp_path / f"s{k}", num_docs=10, seed=20 + k)
        paths.append(str(tmp_path / f"s{k}"))
    train, valid, test = build_train_valid_test_datasets(
        None, "mmap", "969,30,1", [30, 10, 0], 8, 1, True, data_cache_path=str(tmp_path / "c"),
        train_data_prefix=["1", paths[0], "1", paths[1]], valid_data_prefix=[paths[2]])
    assert isinstance(train, BlendableDataset) and len(train) == 30 and test is None
    assert sorted(set(valid.doc_idx.tolist())) == list(range(10)) and len(valid) >= 10


def test_bad_inputs(corpus, tmp_path):
    prefix, _ = corpus
    with pytest.raises(ValueError, match="not found"):
        build_train_valid_test_datasets([str(tmp_path / "nope")], "mmap", "1", [1, 0, 0], 8, 1, True)
    with pytest.raises(ValueError, match="pairs of weight and prefix"):
        build_train_valid_test_datasets(["1", prefix, "2"], "mmap", "1", [1, 0, 0], 8, 1, True)
    with pytest.raises(ValueError, match="train_valid_test_num_samples"):
        build_train_valid_test_datasets([prefix], "mmap", "1", [1, 0], 8, 1, True)


def _all_batches(sampler) -> list:
    return [list(b) for b in sampler]


def test_sequential_sampler_resume_and_sharding():
    total, mb, dp = 103, 3, 2
    full = [_all_batches(MegatronPretrainingSampler(total, 0, mb, r, dp)) for r in range(dp)]
    assert len(full[0]) == total // (mb * dp)
    seen = sorted(i for r in range(dp) for b in full[r] for i in b)
    assert seen == list(range(len(full[0]) * mb * dp))
    assert full[1][0] == [3, 4, 5]
    for step in (1, 5, 16):
        resumed = [_all_batches(MegatronPretrainingSampler(total, step * mb * dp, mb, r, dp)) for r in range(dp)]
        assert resumed == [full[r][step:] for r in range(dp)]
    tail = _all_batches(MegatronPretrainingSampler(total, 0, mb, 0, dp, drop_last=False))
    assert tail[-1] == [102]
    with pytest.raises(ValueError, match="no samples left"):
        MegatronPretrainingSampler(total, total, mb, 0, dp)


@pytest.mark.parametrize("sharding", [True, False])
def test_random_sampler_resume(sharding):
    total, mb, dp = 50, 2, 2
    samplers = [MegatronPretrainingRandomSampler(None, total, 0, mb, r, dp, sharding) for r in range(dp)]
    full = [_all_batches(s) for s in samplers]
    per_epoch = len(full[0])
    assert per_epoch == (total // (mb * dp))
    flat = [i for r in range(dp) for b in full[r] for i in b]
    assert len(set(flat)) == len(flat) and max(flat) < total
    for step in (1, 7):
        resumed = [_all_batches(MegatronPretrainingRandomSampler(None, total, step * mb * dp, mb, r, dp, sharding))
                   for r in range(dp)]
        assert resumed == [full[r][step:] for r in range(dp)]
    # the next epoch is a different permutation and continues from where the first ended
    epoch2 = _all_batches(MegatronPretrainingRandomSampler(None, total, samplers[0].consumed_samples, mb, 0, dp,
                                                           sharding))
    assert len(epoch2) == per_epoch and epoch2 != full[0]


def test_data_loader(corpus, tmp_path):
    prefix, _ = corpus
    train = build_train_valid_test_datasets([prefix], "mmap", "1", [30, 0, 0], 8, 1, True,
                                            data_cache_path=str(tmp_path / "c"))[0]
    loader = build_pretraining_data_loader(train, 4, 2, 1, 2, num_workers=0)
    batches = list(loader)
    assert len(batches) == (len(train) - 4) // 4
    first = batches[0]["text"]
    assert first.dtype == torch.int64 and first.shape == (2, 9)
    np.testing.assert_array_equal(first[0].numpy(), train[6]["text"])
    cyclic = build_pretraining_data_loader(train, 0, 2, 0, 1, num_workers=0, dataloader_type="cyclic")
    assert next(iter(cyclic))["text"].shape == (2, 9)
    assert build_pretraining_data_loader(None, 0, 2, 0, 1, 0) is None
    with pytest.raises(ValueError, match="--dataloader-type"):
        build_pretraining_data_loader(train, 0, 2, 0, 1, 0, dataloader_type="bogus")


@pytest.mark.slow  # a DataLoader worker is a process
def test_data_loader_worker_gives_the_same_batches(corpus, tmp_path):
    prefix, _ = corpus
    train = build_train_valid_test_datasets([prefix], "mmap", "1", [30, 0, 0], 8, 1, True,
                                            data_cache_path=str(tmp_path / "c"))[0]
    batches = list(build_pretraining_data_loader(train, 4, 2, 1, 2, num_workers=0))
    with_workers = list(build_pretraining_data_loader(train, 4, 2, 1, 2, num_workers=1))
    assert len(with_workers) == len(batches) > 0
    assert all(torch.equal(a["text"], b["text"]) for a, b in zip(batches, with_workers))


def _build_on_ranks(rank: int, world_size: int, prefix: str, cache: str, cache_unsync: str) -> dict:
    from megatron.data import gpt_dataset as g

    built = []
    real = g._build_arrays_into
    g._build_arrays_into = lambda *a, **k: (built.append(rank), real(*a, **k))
    train, valid, _ = g.build_train_valid_test_datasets([prefix], "mmap", "90,10,0", [64, 8, 0], 16, 7, True,
                                                        data_cache_path=cache)
    synced = list(built)
    built.clear()
    # no collectives (e.g. only some ranks build data): the file lock makes one process build, the other waits
    train2 = g.build_train_valid_test_datasets([prefix], "mmap", "1", [20, 0, 0], 5, 7, True,
                                               data_cache_path=cache_unsync, synchronize=False)[0]
    return {"built": synced, "built_unsync": list(built), "train": [train[i]["text"].tolist() for i in range(len(train))],
            "valid": [valid[i]["text"].tolist() for i in range(len(valid))],
            "train2": [train2[i]["text"].tolist() for i in range(len(train2))]}


def test_two_ranks_build_cache_once(corpus, tmp_path):
    prefix, _ = corpus
    cache, cache2 = tmp_path / "shared-cache", tmp_path / "unsync-cache"
    results = run_distributed(_build_on_ranks, world_size=2, args=(prefix, str(cache), str(cache2)))
    assert results[0]["built"] == [0, 0] and results[1]["built"] == []
    assert results[0]["train"] == results[1]["train"] and results[0]["valid"] == results[1]["valid"]
    assert len(list(cache.glob("*.dsc"))) == 2 and len(list(cache.glob("*.npy"))) == 6
    assert len(results[0]["built_unsync"] + results[1]["built_unsync"]) == 1
    assert results[0]["train2"] == results[1]["train2"] and len(list(cache2.glob("*.npy"))) == 3
