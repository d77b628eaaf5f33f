"""Tests for tools/merge_preprocessed_data.py, run as a subprocess like a user would."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.data import indexed_dataset as ids


def _build(prefix: Path, docs, impl: str = "mmap", dtype=np.uint16) -> str:
    b = ids.make_builder(f"{prefix}.bin", impl, dtype=dtype)
    for doc in docs:
        b.add_doc(np.concatenate(doc), [len(s) for s in doc])
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def _run(repo_root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(repo_root / "tools" / "merge_preprocessed_data.py"), *args],
                          capture_output=True, text=True, cwd=repo_root)


A = [[np.array([1, 2, 3]), np.array([4])], [np.array([5, 6])]]
B = [[np.array([7])], [np.array([8, 9]), np.array([10])], [np.array([11])]]
C = [[np.array([12, 13, 14, 15])]]


def test_merge_three_mmap_datasets(tmp_path, repo_root):
    parts = [_build(tmp_path / n, d) for n, d in (("a", A), ("b", B), ("c", C))]
    out = tmp_path / "out" / "merged"
    proc = _run(repo_root, "--datasets", *parts, "--output-prefix", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "merged 3 datasets (8 sequences, 15 tokens, uint16, mmap)" in proc.stdout
    ds = ids.make_dataset(str(out), "infer")
    assert isinstance(ds, ids.MMapIndexedDataset) and ds.dtype == np.uint16
    expected = [s.tolist() for doc in A + B + C for s in doc]
    assert [x.tolist() for x in ds[0:len(ds)]] == expected
    assert ds.doc_idx.tolist() == [0, 2, 3, 4, 6, 7, 8]  # B's boundaries shifted by 3, C's by 7
    # The .bin is the plain concatenation of the inputs' .bin files.
    assert Path(f"{out}.bin").read_bytes() == b"".join(Path(f"{p}.bin").read_bytes() for p in parts)
    # Same result as merging in-process with the builder.
    b = ids.make_builder(tmp_path / "ref.bin", "mmap", dtype=np.uint16)
    for p in parts:
        b.merge_file_(p)
    b.finalize(tmp_path / "ref.idx")
    assert Path(f"{out}.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()


def test_merge_refuses_mixed_dtypes_and_writes_nothing(tmp_path, repo_root):
    a = _build(tmp_path / "a", A, dtype=np.uint16)
    b = _build(tmp_path / "b", B, dtype=np.int32)
    proc = _run(repo_root, "--datasets", a, b, "--output-prefix", str(tmp_path / "m"))
    assert proc.returncode == 1
    assert "different token dtypes" in proc.stderr and "(uint16)" in proc.stderr and "(int32)" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("m*"))


def test_merge_reports_missing_corrupt_and_wrong_format_inputs(tmp_path, repo_root):
    a = _build(tmp_path / "a", A)
    proc = _run(repo_root, "--datasets", a, str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "m"))
    assert proc.returncode == 1 and "nope.idx" in proc.stderr and "not found" in proc.stderr
    c = _build(tmp_path / "c", C)
    Path(f"{c}.bin").write_bytes(Path(f"{c}.bin").read_bytes()[:-2])
    proc = _run(repo_root, "--datasets", a, c, "--output-prefix", str(tmp_path / "m"))
    assert proc.returncode == 1 and "c.bin holds 6 bytes" in proc.stderr and "truncated" in proc.stderr
    legacy = _build(tmp_path / "l", A, impl="lazy", dtype=np.uint16)
    proc = _run(repo_root, "--datasets", a, legacy, "--output-prefix", str(tmp_path / "m"))
    assert proc.returncode == 1 and "legacy lazy/cached dataset but --dataset-impl is mmap" in proc.stderr
    proc = _run(repo_root, "--datasets", a, "--output-prefix", a)
    assert proc.returncode == 1 and "also one of --datasets" in proc.stderr
    assert not list(tmp_path.glob("m*"))


@pytest.mark.parametrize("impl", ["lazy", "infer"])
def test_merge_legacy_datasets(tmp_path, repo_root, impl):
    parts = [_build(tmp_path / n, d, impl="lazy", dtype=np.int32) for n, d in (("a", A), ("b", B))]
    out = tmp_path / "merged"
    proc = _run(repo_root, "--datasets", *parts, "--output-prefix", str(out), "--dataset-impl", impl)
    assert proc.returncode == 0, proc.stderr
    ds = ids.make_dataset(str(out), "lazy")
    assert [x.tolist() for x in ds[0:len(ds)]] == [s.tolist() for doc in A + B for s in doc]
    assert ds.doc_idx.tolist() == [0, 2, 3, 4, 6, 7]
