"""The C++ dataset index helpers equal the slow Python references, validate input, and build on first use."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from megatron.data import helpers
from megatron.data.helpers import build_blending_indices_py, build_sample_idx_py, get_helpers
from tests.dist_utils import run_distributed


@pytest.fixture(scope="module")
def cpp():
    return get_helpers()


def _random_case(rng: np.random.Generator, with_zero_docs: bool):
    num_docs = int(rng.integers(1, 40))
    sizes = rng.integers(0 if with_zero_docs else 1, 60, size=num_docs).astype(np.int32)
    if sizes.sum() < 2:
        sizes[0] = 2
    documents = np.sort(rng.choice(num_docs, size=int(rng.integers(1, num_docs + 1)), replace=False))
    if sizes[documents].sum() < 2:
        documents = np.arange(num_docs)
    num_epochs = int(rng.integers(1, 4))
    doc_idx = np.tile(documents, num_epochs)
    rng.shuffle(doc_idx)
    tokens_per_epoch = int(sizes[documents].sum())
    seq_length = int(rng.integers(1, 80))
    return sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch


@pytest.mark.parametrize("doc_dtype", [np.int32, np.int64])
def test_build_sample_idx_matches_reference(cpp, doc_dtype):
    rng = np.random.default_rng(1234)
    for trial in range(300):
        sizes, doc_idx, seq_length, num_epochs, tokens = _random_case(rng, with_zero_docs=trial % 2 == 1)
        doc_idx = doc_idx.astype(doc_dtype)
        got = cpp.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens)
        want = build_sample_idx_py(sizes, doc_idx, seq_length, num_epochs, tokens)
        assert got.dtype == np.dtype(doc_dtype)
        assert got.shape == ((num_epochs * tokens - 1) // seq_length + 1, 2)
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")


def test_build_sample_idx_samples_cover_token_stream(cpp):
    """Each (start, next start) pair spans exactly seq_length + 1 tokens of the concatenated documents."""
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 20, size=25).astype(np.int32)
    doc_idx = rng.permutation(np.tile(np.arange(25), 2)).astype(np.int32)
    seq = 9
    idx = cpp.build_sample_idx(sizes, doc_idx, seq, 2, int(sizes.sum()))
    starts = np.concatenate([[0], np.cumsum(sizes[doc_idx])])
    for i in range(len(idx) - 1):
        begin = starts[idx[i, 0]] + idx[i, 1]
        end = starts[idx[i + 1, 0]] + idx[i + 1, 1]
        assert (begin, end) == (i * seq, (i + 1) * seq)


def test_build_sample_idx_known_values(cpp):
    sizes = np.array([3, 4, 5], dtype=np.int32)
    out = cpp.build_sample_idx(sizes, np.array([0, 1, 2], dtype=np.int32), 4, 1, 12)
    np.testing.assert_array_equal(out, [[0, 0], [1, 1], [2, 1]])
    # the Megatron-style module-level forwarders give the same
    np.testing.assert_array_equal(helpers.build_sample_idx(sizes, np.array([0, 1, 2], dtype=np.int32), 4, 1, 12), out)
    index, sample = np.zeros(4, np.uint8), np.zeros(4, np.int64)
    helpers.build_blending_indices(index, sample, np.array([0.5, 0.5]), 2, 4, False)
    assert index.tolist() == [0, 1, 0, 1] and sample.tolist() == [0, 0, 1, 1]


def test_build_sample_idx_accepts_strided_input(cpp):
    sizes = np.array([5, 0, 7, 0, 2, 0], dtype=np.int32)[::2]
    doc_idx = np.array([2, 9, 0, 9, 1, 9], dtype=np.int64)[::2]
    out = cpp.build_sample_idx(sizes, doc_idx, 3, 1, 14)
    np.testing.assert_array_equal(out, build_sample_idx_py(np.ascontiguousarray(sizes), doc_idx, 3, 1, 14))


def test_build_sample_idx_rejects_bad_input(cpp):
    sizes = np.array([3, 4], dtype=np.int32)
    doc_idx = np.array([0, 1], dtype=np.int32)
    with pytest.raises(TypeError, match="sizes must be a numpy array of dtype int32"):
        cpp.build_sample_idx(sizes.astype(np.int64), doc_idx, 2, 1, 7)
    with pytest.raises(TypeError, match="doc_idx must be a numpy array of dtype int64"):
        cpp.build_sample_idx(sizes, doc_idx.astype(np.float32), 2, 1, 7)
    with pytest.raises(ValueError, match="seq_length must be positive"):
        cpp.build_sample_idx(sizes, doc_idx, 0, 1, 7)
    with pytest.raises(ValueError, match="doc_idx contains document 5"):
        cpp.build_sample_idx(sizes, np.array([0, 5], dtype=np.int32), 2, 1, 7)
    with pytest.raises(ValueError, match="ran past the end of doc_idx"):
        cpp.build_sample_idx(sizes, doc_idx, 2, 1, 70)


def test_build_blending_indices_matches_reference(cpp):
    rng = np.random.default_rng(99)
    cases = [np.array([0.5, 0.5]), np.array([1.0]), np.array([0.3, 0.7]), np.array([0.2, 0.0, 0.8])]
    cases += [rng.dirichlet(np.ones(int(rng.integers(2, 9)))) for _ in range(20)]
    for weights in cases:
        size = int(rng.integers(0, 600))
        index = np.full(size, 255, dtype=np.uint8)
        sample = np.full(size, -1, dtype=np.int64)
        cpp.build_blending_indices(index, sample, weights, len(weights), size, False)
        want_index, want_sample = build_blending_indices_py(weights, size)
        np.testing.assert_array_equal(index, want_index)
        np.testing.assert_array_equal(sample, want_sample)
        if size > 100:
            achieved = np.bincount(index, minlength=len(weights)) / size
            np.testing.assert_allclose(achieved, weights, atol=2.0 / size + 1e-12)


def test_build_blending_indices_verbose_and_errors(cpp, capfd):
    index = np.zeros(10, dtype=np.uint8)
    sample = np.zeros(10, dtype=np.int64)
    cpp.build_blending_indices(index, sample, np.array([0.25, 0.75]), 2, 10, True)
    assert "achieved" in capfd.readouterr().out
    with pytest.raises(TypeError, match="dataset_index must be a numpy array of dtype uint8"):
        cpp.build_blending_indices(index.astype(np.int32), sample, np.array([1.0]), 1, 10, False)
    with pytest.raises(ValueError, match="weights has 1 entries but num_datasets is 2"):
        cpp.build_blending_indices(index, sample, np.array([1.0]), 2, 10, False)
    with pytest.raises(ValueError, match="shorter than size"):
        cpp.build_blending_indices(index, sample, np.array([1.0]), 1, 11, False)
    with pytest.raises(ValueError, match="writable C-contiguous"):
        cpp.build_blending_indices(np.zeros(20, np.uint8)[::2], sample, np.array([1.0]), 1, 10, False)


def test_missing_compiler_gives_clear_error(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(helpers.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found"):
        helpers._compiler()


def _build_on_rank0(rank: int, world_size: int, build_dir: str) -> dict:
    """Force a fresh build into build_dir via compile_helpers_rank0; report what each rank saw."""
    import numpy as np

    from megatron.data import helpers as h

    h._import_installed = lambda: None
    h._candidate_dirs = lambda tag: [Path(build_dir) / tag]
    compiled = []
    real_compile = h._compile
    h._compile = lambda path: (compiled.append(str(path)), real_compile(path))
    module = h.compile_helpers_rank0()
    out = module.build_sample_idx(np.array([3, 4, 5], np.int32), np.array([0, 1, 2], np.int32), 4, 1, 12)
    return {"compiled": compiled, "origin": module.__file__, "out": out.tolist()}


def test_compile_on_first_use_rank0_builds_others_wait(tmp_path):
    results = run_distributed(_build_on_rank0, world_size=2, args=(str(tmp_path),))
    assert len(results[0]["compiled"]) == 1 and results[1]["compiled"] == []
    built = list(tmp_path.glob("*/helpers_cpp*"))
    assert len(built) == 1 and os.path.samefile(results[1]["origin"], built[0])
    assert results[0]["out"] == results[1]["out"] == [[0, 0], [1, 1], [2, 1]]
