"""Tests for megatron/data/indexed_dataset.py: byte layouts, round trips, merging, corruption checks, atomic writes."""
from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.data import indexed_dataset as ids

ALL_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16]


def _seqs(dtype, n: int = 7, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    hi = 100 if np.dtype(dtype).kind in "iu" else 1000
    return [(rng.integers(0, hi, size=int(k)) * (1 if np.dtype(dtype).kind in "iu" else 0.25)).astype(dtype)
            for k in rng.integers(0, 9, size=n)]


def _build_mmap(prefix: Path, docs: list[list[np.ndarray]], dtype=np.uint16) -> Path:
    b = ids.MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        for s in doc:
            b.add_item(s)
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return prefix


def _expected_mmap_idx(dtype_code: int, sizes: list[int], itemsize: int, doc_idx: list[int]) -> bytes:
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx))
    out += b"".join(struct.pack("<i", s) for s in sizes)
    ptr = 0
    for s in sizes:
        out += struct.pack("<q", ptr)
        ptr += s * itemsize
    out += b"".join(struct.pack("<q", d) for d in doc_idx)
    return out


# ------------------------------------------------------------------------------------------------ mmap format
def test_mmap_byte_layout(tmp_path):
    prefix = _build_mmap(tmp_path / "d", [[np.array([1, 2, 3]), np.array([4, 5])], [np.array([65535])]])
    idx = (tmp_path / "d.idx").read_bytes()
    assert idx == _expected_mmap_idx(8, [3, 2, 1], 2, [0, 2, 3])
    assert len(idx) == 34 + 12 * 3 + 8 * 3
    assert (tmp_path / "d.bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 4, 5, 65535)
    ds = ids.MMapIndexedDataset(str(prefix))
    assert ds[2].tolist() == [65535] and ds.dtype == np.uint16


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_mmap_round_trip_every_dtype(tmp_path, dtype):
    seqs = _seqs(dtype)
    docs = [seqs[:3], seqs[3:4], seqs[4:]]
    _build_mmap(tmp_path / "d", docs, dtype=dtype)
    code = {np.dtype(v): k for k, v in ids.DTYPES.items()}[np.dtype(dtype)]
    sizes = [len(s) for s in seqs]
    expected = _expected_mmap_idx(code, sizes, np.dtype(dtype).itemsize, [0, 3, 4, 7])
    assert (tmp_path / "d.idx").read_bytes() == expected
    ds = ids.make_dataset(str(tmp_path / "d"), "mmap")
    assert isinstance(ds, ids.MMapIndexedDataset) and len(ds) == len(seqs)
    assert ds.dtype == np.dtype(dtype) and ds.sizes.dtype == np.int32 and ds.doc_idx.dtype == np.int64
    assert ds.sizes.tolist() == sizes and ds.doc_idx.tolist() == [0, 3, 4, 7]
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
        assert ds[i].dtype == np.dtype(dtype)
    assert [a.tolist() for a in ds[1:5]] == [s.tolist() for s in seqs[1:5]]
    assert (tmp_path / "d.bin").stat().st_size == sum(sizes) * np.dtype(dtype).itemsize


def test_mmap_reads_are_zero_copy_views(tmp_path):
    _build_mmap(tmp_path / "d", [[np.arange(10), np.arange(5)]])
    ds = ids.MMapIndexedDataset(str(tmp_path / "d"))
    a = ds[0]
    assert not a.flags.owndata and not a.flags.writeable
    assert a.base is not None
    assert all(not x.flags.owndata for x in ds[0:2])


def test_mmap_get_slices_and_negative_index(tmp_path):
    _build_mmap(tmp_path / "d", [[np.arange(10), np.arange(100, 105)]])
    ds = ids.MMapIndexedDataset(str(tmp_path / "d"))
    assert ds.get(0).tolist() == list(range(10))
    assert ds.get(0, offset=3, length=4).tolist() == [3, 4, 5, 6]
    assert ds.get(1, offset=2).tolist() == [102, 103, 104]
    assert ds.get(1, offset=5).tolist() == []
    assert ds[-1].tolist() == [100, 101, 102, 103, 104]
    assert ds[1:1] == [] and len(ds[:]) == 2
    with pytest.raises(IndexError, match="outside sequence 0"):
        ds.get(0, offset=8, length=5)
    with pytest.raises(IndexError, match="out of range"):
        ds[2]
    with pytest.raises(ValueError, match="contiguous"):
        ds[0:2:2]
    assert ds.supports_prefetch is False
    warm = ids.MMapIndexedDataset(str(tmp_path / "d"), skip_warmup=False)
    assert warm[1].tolist() == [100, 101, 102, 103, 104]
    assert ids.create_doc_idx([3, 0, 2, 2, 0]).tolist() == [0, 2, 5]
    assert ids.MMapIndexedDataset.exists(str(tmp_path / "d")) and not ids.MMapIndexedDataset.exists(str(tmp_path / "x"))


def test_empty_mmap_dataset(tmp_path):
    b = ids.make_builder(tmp_path / "e.bin", "mmap", vocab_size=100)
    b.finalize(tmp_path / "e.idx")
    assert (tmp_path / "e.idx").stat().st_size == 34 + 8
    ds = ids.make_dataset(str(tmp_path / "e"), "infer")
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0] and ds[0:0] == []


def test_add_doc_equals_add_item_bytes(tmp_path):
    rng = np.random.default_rng(1)
    docs = [[rng.integers(0, 50000, size=int(k)) for k in rng.integers(1, 20, size=int(m))]
            for m in rng.integers(1, 5, size=6)]
    _build_mmap(tmp_path / "items", docs)
    b = ids.make_builder(str(tmp_path / "docs.bin"), "mmap", vocab_size=30000)
    for i, doc in enumerate(docs):
        tokens = np.concatenate(doc) if i % 2 else np.concatenate(doc).tolist()
        lengths = [len(s) for s in doc]
        b.add_doc(tokens, np.array(lengths) if i % 3 == 0 else lengths)
    b.finalize(str(tmp_path / "docs.idx"))
    assert (tmp_path / "docs.bin").read_bytes() == (tmp_path / "items.bin").read_bytes()
    assert (tmp_path / "docs.idx").read_bytes() == (tmp_path / "items.idx").read_bytes()


def test_best_fitting_dtype_and_builder_dtypes(tmp_path):
    assert ids.best_fitting_dtype(None) == np.int32
    assert ids.best_fitting_dtype(65499) == np.uint16 and ids.best_fitting_dtype(65500) == np.int32
    assert ids.make_builder(tmp_path / "a.bin", "mmap", vocab_size=50257).dtype == np.uint16
    assert ids.make_builder(tmp_path / "b.bin", "mmap", vocab_size=250000).dtype == np.int32
    assert ids.make_builder(tmp_path / "c.bin", "lazy").dtype == np.int32
    with pytest.raises(ValueError, match="cannot store dtype"):
        ids.MMapIndexedDatasetBuilder(tmp_path / "d.bin", dtype=np.complex64)
    with pytest.raises(ValueError, match="unknown dataset impl"):
        ids.make_builder(tmp_path / "e.bin", "foo")


def test_builder_accepts_torch_tensors_and_rejects_overflow(tmp_path):
    torch = pytest.importorskip("torch")
    b = ids.MMapIndexedDatasetBuilder(tmp_path / "t.bin", dtype=np.uint16)
    b.add_item(torch.tensor([1, 2, 3]))
    b.add_doc(torch.tensor([4, 5, 6, 7], dtype=torch.int64), torch.tensor([2, 2]))
    with pytest.raises(ids.IndexedDatasetError, match="does not fit"):
        b.add_item(np.array([1, 70000]))
    with pytest.raises(ids.IndexedDatasetError, match="uint16"):
        b.add_item([1, 70000])
    with pytest.raises(ids.IndexedDatasetError, match="summing to 3"):
        b.add_doc([1, 2], [1, 2])
    b.end_document()
    b.finalize(tmp_path / "t.idx")
    ds = ids.MMapIndexedDataset(str(tmp_path / "t"))
    assert [x.tolist() for x in ds[0:3]] == [[1, 2, 3], [4, 5], [6, 7]]
    assert ds.doc_idx.tolist() == [0, 3, 3]


@pytest.mark.slow  # DataLoader worker processes
def test_pickle_and_dataloader_workers(tmp_path):
    _build_mmap(tmp_path / "d", [[np.arange(4), np.arange(3)], [np.arange(2)]])
    ds = ids.make_dataset(str(tmp_path / "d"), "mmap")
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone) == 3 and [a.tolist() for a in clone[0:3]] == [a.tolist() for a in ds[0:3]]
    assert clone.doc_idx.tolist() == [0, 2, 3]
    lazy = _build_legacy(tmp_path / "l", [[np.arange(4)]])
    lazy_ds = ids.make_dataset(str(lazy), "lazy")
    lazy_ds[0]  # opens the .bin handle; pickling must drop it
    assert pickle.loads(pickle.dumps(lazy_ds))[0].tolist() == [0, 1, 2, 3]
    torch = pytest.importorskip("torch")
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, collate_fn=lambda x: x.tolist())
    assert list(loader) == [[0, 1, 2, 3], [0, 1, 2], [0, 1]]


def test_builder_merge_file(tmp_path):
    _build_mmap(tmp_path / "a", [[np.array([1, 2]), np.array([3])], [np.array([4])]])
    _build_mmap(tmp_path / "b", [[np.array([5, 6, 7])], [np.array([8]), np.array([9])]])
    b = ids.MMapIndexedDatasetBuilder(tmp_path / "m.bin", dtype=np.uint16)
    b.add_doc([10, 11], [2])
    b.merge_file_(str(tmp_path / "a"))
    b.merge_file_(str(tmp_path / "b"))
    b.finalize(tmp_path / "m.idx")
    ds = ids.MMapIndexedDataset(str(tmp_path / "m"))
    assert [x.tolist() for x in ds[0:len(ds)]] == [[10, 11], [1, 2], [3], [4], [5, 6, 7], [8], [9]]
    assert ds.doc_idx.tolist() == [0, 1, 3, 4, 5, 7]
    _build_mmap(tmp_path / "c", [[np.array([1])]], dtype=np.int32)
    b = ids.MMapIndexedDatasetBuilder(tmp_path / "n.bin", dtype=np.uint16)
    with pytest.raises(ids.IndexedDatasetError, match="int32 but .* holds uint16"):
        b.merge_file_(str(tmp_path / "c"))
    b.abort()
    assert list(tmp_path.glob("n.*")) == []


def test_large_builds_pack_sizes_and_stream_in_chunks(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    docs = [[rng.integers(0, 60000, size=int(k)) for k in rng.integers(0, 30, size=int(m))]
            for m in rng.integers(1, 6, size=40)]
    _build_mmap(tmp_path / "ref", docs)
    monkeypatch.setattr(ids, "FLUSH", 3)  # pack python lists into numpy chunks every 3 entries
    monkeypatch.setattr(ids, "COPY_CHUNK", 7)  # stream merged .bin files 7 bytes at a time
    b = ids.MMapIndexedDatasetBuilder(tmp_path / "packed.bin", dtype=np.uint16)
    for doc in docs[:20]:
        b.add_doc(np.concatenate(doc) if doc else [], [len(s) for s in doc])
    _build_mmap(tmp_path / "tail", docs[20:])
    b.merge_file_(str(tmp_path / "tail"))
    b.finalize(tmp_path / "packed.idx")
    assert (tmp_path / "packed.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    assert (tmp_path / "packed.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()


# ------------------------------------------------------------------------------------------------ legacy formats
def _build_legacy(prefix: Path, docs, dtype=np.int32) -> Path:
    b = ids.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        for s in doc:
            b.add_item(s)
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return prefix


def test_legacy_byte_layout(tmp_path):
    _build_legacy(tmp_path / "l", [[np.array([1, 2, 3]), np.array([4, 5])], [np.array([6])]])
    longs = [0, 1, 2, 3] + [0, 3, 5, 6] + [3, 2, 1] + [0, 2, 3]  # dim_offsets, data_offsets, sizes, doc_idx
    expected = b"TNTIDX\x00\x00" + struct.pack("<QQQQQQ", 1, 4, 4, 3, 3, 3) + struct.pack(f"<{len(longs)}q", *longs)
    idx = (tmp_path / "l.idx").read_bytes()
    assert idx == expected
    assert len(idx) == 56 + 8 * (2 * 4 + 3 + 3)
    assert (tmp_path / "l.bin").read_bytes() == struct.pack("<6i", 1, 2, 3, 4, 5, 6)


@pytest.mark.parametrize("impl", ["lazy", "cached"])
@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.float32, np.int64])
def test_legacy_round_trip(tmp_path, impl, dtype):
    seqs = _seqs(dtype, n=6, seed=3)
    prefix = _build_legacy(tmp_path / "l", [seqs[:2], seqs[2:]], dtype=dtype)
    assert ids.infer_dataset_impl(str(prefix)) == "cached"
    ds = ids.make_dataset(str(prefix), impl)
    assert type(ds) is (ids.IndexedDataset if impl == "lazy" else ids.IndexedCachedDataset)
    assert ds.supports_prefetch is (impl == "cached")
    if impl == "cached":
        ds.prefetch([1, 3])
        assert set(ds.cache_index) == {1, 3}
    assert len(ds) == 6 and ds.sizes.tolist() == [len(s) for s in seqs] and ds.doc_idx.tolist() == [0, 2, 6]
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
        assert ds[i].dtype == np.dtype(dtype)
    assert [a.tolist() for a in ds[1:4]] == [s.tolist() for s in seqs[1:4]]
    np.testing.assert_array_equal(ds.get(5, 1), seqs[5][1:])


def test_legacy_multidim_items_and_merge(tmp_path):
    _build_legacy(tmp_path / "a", [[np.arange(6).reshape(2, 3), np.array([7])]])
    _build_legacy(tmp_path / "b", [[np.array([8, 9])], [np.arange(4).reshape(2, 2)]])
    b = ids.make_builder(tmp_path / "m.bin", "lazy")
    b.add_doc([1, 2, 3], [1, 2])
    b.merge_file_(str(tmp_path / "a"))
    b.merge_file_(str(tmp_path / "b"))
    b.finalize(tmp_path / "m.idx")
    ds = ids.make_dataset(str(tmp_path / "m"), "infer")
    assert isinstance(ds, ids.IndexedCachedDataset)
    assert ds[2].shape == (2, 3) and ds[2].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert [x.tolist() for x in ds[0:len(ds)]] == [[1], [2, 3], [[0, 1, 2], [3, 4, 5]], [7], [8, 9], [[0, 1], [2, 3]]]
    assert ds.doc_idx.tolist() == [0, 2, 5, 6, 8]  # counts size entries, as Megatron does
    _build_legacy(tmp_path / "c", [[np.array([1])]], dtype=np.int64)
    b = ids.make_builder(tmp_path / "n.bin", "lazy")
    with pytest.raises(ids.IndexedDatasetError, match="int64 but .* holds int32"):
        b.merge_file_(str(tmp_path / "c"))
    b.abort()


def test_legacy_reader_accepts_old_layout_without_doc_idx(tmp_path):
    _build_legacy(tmp_path / "l", [[np.array([1, 2]), np.array([3])]])
    raw = (tmp_path / "l.idx").read_bytes()
    (tmp_path / "l.idx").write_bytes(raw[:48] + raw[56:-8 * 2])  # drop the doc count and doc_idx
    ds = ids.IndexedDataset(str(tmp_path / "l"))
    assert ds.doc_idx.tolist() == [0, 1, 2] and ds[1].tolist() == [3]


# ------------------------------------------------------------------------------------------------ infer / lookup
def test_infer_make_dataset_and_exists(tmp_path):
    _build_mmap(tmp_path / "m", [[np.array([1])]])
    _build_legacy(tmp_path / "l", [[np.array([1])]])
    assert ids.infer_dataset_impl(str(tmp_path / "m")) == "mmap"
    assert ids.infer_dataset_impl(str(tmp_path / "l")) == "cached"
    assert ids.infer_dataset_impl(str(tmp_path / "none")) is None
    assert isinstance(ids.make_dataset(str(tmp_path / "m"), "infer"), ids.MMapIndexedDataset)
    assert ids.dataset_exists(str(tmp_path / "m"), "mmap") and not ids.dataset_exists(str(tmp_path / "x"), "lazy")
    assert ids.data_file_path("p") == "p.bin" and ids.index_file_path("p") == "p.idx"
    with pytest.raises(ids.IndexedDatasetError, match="legacy"):
        ids.make_dataset(str(tmp_path / "l"), "mmap")
    with pytest.raises(ids.IndexedDatasetError, match="is an mmap index"):
        ids.make_dataset(str(tmp_path / "m"), "lazy")
    with pytest.raises(ids.IndexedDatasetError, match=r"without '\.bin'"):
        ids.make_dataset(str(tmp_path / "m.bin"), "infer")
    with pytest.raises(ValueError, match="unknown --data-impl"):
        ids.make_dataset(str(tmp_path / "m"), "bogus")
    (tmp_path / "m.idx").write_bytes(b"GARBAGE!" * 8)
    with pytest.raises(ids.IndexedDatasetError, match="neither an mmap"):
        ids.infer_dataset_impl(str(tmp_path / "m"))


# ------------------------------------------------------------------------------------------------ corruption
def _corrupt(tmp_path: Path, what: str) -> Path:
    prefix = _build_mmap(tmp_path / "c", [[np.arange(5), np.arange(3)], [np.arange(4)]])
    idx, binf = tmp_path / "c.idx", tmp_path / "c.bin"
    raw = bytearray(idx.read_bytes())
    if what == "truncated_idx":
        idx.write_bytes(raw[:-5])
    elif what == "short_header":
        idx.write_bytes(raw[:20])
    elif what == "trailing_idx":
        idx.write_bytes(bytes(raw) + b"\0" * 8)
    elif what == "truncated_bin":
        binf.write_bytes(binf.read_bytes()[:-2])
    elif what == "magic":
        raw[0:4] = b"XXXX"
        idx.write_bytes(raw)
    elif what == "version":
        raw[9:17] = struct.pack("<Q", 2)
        idx.write_bytes(raw)
    elif what == "dtype_code":
        raw[17] = 42
        idx.write_bytes(raw)
    elif what == "other_bin":
        _build_mmap(tmp_path / "o", [[np.arange(50)]])
        binf.write_bytes((tmp_path / "o.bin").read_bytes())
    elif what == "doc_idx_order":
        raw[-16:-8] = struct.pack("<q", 3)  # doc_idx = [0, 3, 3] is fine; make it [0, 3, 1]
        raw[-8:] = struct.pack("<q", 1)
        idx.write_bytes(raw)
    elif what == "doc_idx_range":
        raw[-8:] = struct.pack("<q", 9)
        idx.write_bytes(raw)
    elif what == "pointer":
        raw[34 + 12 + 8:34 + 12 + 16] = struct.pack("<q", 4)
        idx.write_bytes(raw)
    elif what == "missing_bin":
        binf.unlink()
    return prefix


@pytest.mark.parametrize(
    "what, message",
    [
        ("truncated_idx", r"c\.idx is \d+ bytes but its header promises 3 sequences .* truncated"),
        ("short_header", r"c\.idx is 20 bytes, shorter than the 34-byte"),
        ("trailing_idx", r"trailing bytes"),
        ("truncated_bin", r"c\.bin holds 22 bytes but .*c\.idx promises 24 = 12 tokens x 2 bytes; the \.bin is truncated"),
        ("magic", r"not an mmap index: magic"),
        ("version", r"unsupported mmap index version 2"),
        ("dtype_code", r"unknown dtype code 42"),
        ("other_bin", r"c\.bin holds 100 bytes .*belongs to another index"),
        ("doc_idx_order", r"doc_idx is not monotone"),
        ("doc_idx_range", r"doc_idx ends at 9 but the index holds only 3 sequences"),
        ("pointer", r"pointers\[1\] = 4 but the sizes before it imply 10"),
        ("missing_bin", r"not found: missing .*c\.bin;"),
    ],
)
def test_mmap_corruption_gives_one_line_error(tmp_path, what, message):
    prefix = _corrupt(tmp_path, what)
    with pytest.raises(ids.IndexedDatasetError, match=message) as info:
        ids.make_dataset(str(prefix), "mmap")
    assert "\n" not in str(info.value) and "preprocess_data.py" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "what, message",
    [
        ("truncated_idx", r"l\.idx is \d+ bytes but its header promises 2 items"),
        ("truncated_bin", r"l\.bin holds 8 bytes but .* promises 12 = 3 elements x 4 bytes"),
        ("magic", r"not a legacy index"),
        ("version", r"unsupported legacy index version 7"),
        ("dtype_code", r"unknown dtype code 99"),
        ("element_size", r"element size 3 does not match dtype int32"),
        ("offsets", r"data_offsets disagree with sizes"),
    ],
)
def test_legacy_corruption_gives_one_line_error(tmp_path, what, message):
    prefix = _build_legacy(tmp_path / "l", [[np.array([1, 2]), np.array([3])]])
    idx, binf = tmp_path / "l.idx", tmp_path / "l.bin"
    raw = bytearray(idx.read_bytes())
    if what == "truncated_idx":
        raw = raw[:-4]
    elif what == "truncated_bin":
        binf.write_bytes(binf.read_bytes()[:-4])
    elif what == "magic":
        raw[0:2] = b"ZZ"
    elif what == "version":
        raw[8:16] = struct.pack("<Q", 7)
    elif what == "dtype_code":
        raw[16:24] = struct.pack("<Q", 99)
    elif what == "element_size":
        raw[24:32] = struct.pack("<Q", 3)
    elif what == "offsets":
        raw[56 + 3 * 8 + 8:56 + 3 * 8 + 16] = struct.pack("<q", 1)  # data_offsets[1] = 1 but sizes[0] = 2
    idx.write_bytes(bytes(raw))
    for impl in ("lazy", "cached") if what == "magic" else ("lazy", "cached", "infer"):
        with pytest.raises(ids.IndexedDatasetError, match=message) as info:
            ids.make_dataset(str(prefix), impl)
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ atomic writes
def test_unfinished_builder_leaves_no_final_files(tmp_path):
    for impl in ("mmap", "lazy"):
        b = ids.make_builder(tmp_path / f"{impl}.bin", impl, vocab_size=1000)
        b.add_item([1, 2, 3])
        assert not (tmp_path / f"{impl}.bin").exists()
        b.abort()
    assert list(tmp_path.iterdir()) == []


def test_failed_finalize_cleans_up_and_keeps_old_pair(tmp_path):
    _build_mmap(tmp_path / "d", [[np.array([1, 2])]])
    before = (tmp_path / "d.bin").read_bytes(), (tmp_path / "d.idx").read_bytes()
    b = ids.MMapIndexedDatasetBuilder(tmp_path / "d.bin", dtype=np.uint16)
    b.add_item([7, 8, 9])
    b._doc_idx.append(99)  # an impossible document boundary: the index writer refuses it
    with pytest.raises(ids.IndexedDatasetError, match="doc_idx ends at 99"):
        b.finalize(tmp_path / "d.idx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]
    assert ((tmp_path / "d.bin").read_bytes(), (tmp_path / "d.idx").read_bytes()) == before
    with pytest.raises(RuntimeError, match="already finalized"):
        b.finalize(tmp_path / "d.idx")


_KILLED_WRITER = """
import os, sys
import numpy as np
from megatron.data import indexed_dataset as ids
b = ids.make_builder(sys.argv[1] + ".bin", sys.argv[2], vocab_size=1000)
for i in range(100):
    b.add_item(np.arange(i % 7 + 1))
    b.end_document()
os._exit(3)  # dies before finalize, like a killed preprocessing job
"""


@pytest.mark.parametrize("impl", ["mmap", "lazy"])
def test_killed_writer_leaves_only_temporary_files(tmp_path, repo_root, impl):
    env = dict(os.environ, PYTHONPATH=str(repo_root))
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path / "out"), impl], env=env)
    assert proc.returncode == 3
    names = [p.name for p in tmp_path.iterdir()]
    assert names and all(".tmp-" in n for n in names)
    assert not ids.dataset_exists(str(tmp_path / "out"), impl)


def test_module_import_does_not_import_torch(repo_root):
    code = "import sys; import megatron.data.indexed_dataset; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(repo_root)),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
