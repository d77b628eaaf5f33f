"""Benchmark the BERT/T5 data path against literal re-implementations of Megatron's algorithms, in the same run.

1. Samples mapping (`build_mapping`, C++) vs the pure-Python reference of the tests, one epoch over the corpus.
2. BERT samples (seq 512, binary head) and T5 samples (encoder 512 / decoder 128) per second: ours vs the literal
   Megatron-shaped sample builders of the tests (tests/data/megatron_data_reference.py); outputs checked equal.
Corpus: OpenWebText-1000 (the full file when ../shared/data is present, else the 200-document fixture), sentence-split
and WordPiece-tokenized here. Run from the repository root: `python tools/benchmarks/bench_bert_t5_data.py`.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron.data.bert_dataset import BertDataset  # noqa: E402
from megatron.data.dataset_utils import build_samples_mapping  # noqa: E402
from megatron.data.indexed_dataset import make_dataset  # noqa: E402
from megatron.data.t5_dataset import T5Dataset  # noqa: E402
from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer  # noqa: E402
from tests.data import megatron_data_reference as ref  # noqa: E402
from tests.data.test_bert_dataset import preprocess  # noqa: E402
from tests.data.test_samples_mapping import reference_build_mapping  # noqa: E402
from tests.fixtures import wide_data  # noqa: E402


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=300, help="samples timed per builder")
    args = parser.parse_args()
    data = wide_data()
    tok = BertWordPieceTokenizer(str(data / "bert-wordpiece" / "bert-base-uncased-vocab.txt"), vocab_extra_ids=100)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        prefix = preprocess(data, Path(tmp), "owt", 1000, "--split-sentences", "--workers", "2")
        print(f"preprocessed {data / 'openwebtext-1000'} in {time.perf_counter() - start:.1f} s")
        indexed = make_dataset(prefix, "mmap", True)
        docs, sizes = np.asarray(indexed.doc_idx), np.asarray(indexed.sizes)
        print(f"corpus: {len(docs) - 1} documents, {len(sizes)} sentences, {int(sizes.sum())} tokens")

        build_samples_mapping(docs[:3], sizes, 1, 1, 509, 0.1, 1234, 2)  # load the compiled helpers first
        cpp, t_cpp = timed(build_samples_mapping, docs, sizes, 1, 2**62, 509, 0.1, 1234, 2)
        py, t_py = timed(reference_build_mapping, docs, sizes, 1, 2**62, 509, 0.1, 1234, 2)
        assert np.array_equal(cpp.astype(np.int64), py)
        print(f"build_mapping (1 epoch, {len(cpp)} rows): C++ {t_cpp * 1e3:.2f} ms vs Python reference "
              f"{t_py * 1e3:.0f} ms -> {t_py / t_cpp:.0f}x; equal")

        n = args.samples
        bert = BertDataset("train", indexed, prefix, None, n, 0.15, 512, 0.1, 1234, True, tokenizer=tok)
        [bert[i] for i in range(20)]  # warm-up
        _, t_ours = timed(lambda: [bert[i] for i in range(n)])
        def bert_ref(i):
            s, e, t = (int(v) for v in bert.samples_mapping[i])
            return ref.bert_sample([indexed[j].tolist() for j in range(s, e)], t, 512, bert.vocab_id_list,
                                   bert.vocab_id_to_token_dict, bert.cls_id, bert.sep_id, bert.mask_id, bert.pad_id,
                                   0.15, 1234, i, True)
        want, t_ref = timed(lambda: [bert_ref(i) for i in range(n)])
        assert all(np.array_equal(bert[i][k], want[i][k]) for i in range(n) for k in want[i])
        print(f"BERT samples (seq 512): ours {n / t_ours:.0f}/s ({t_ours / n * 1e3:.2f} ms) vs Megatron-shaped "
              f"reference {n / t_ref:.0f}/s -> {t_ref / t_ours:.2f}x; equal")

        t5 = T5Dataset("train", indexed, prefix, None, n, 0.15, 512, 128, 0.1, 1234, tokenizer=tok)
        [t5[i] for i in range(20)]  # warm-up
        _, t_ours = timed(lambda: [t5[i] for i in range(n)])
        def t5_ref(i):
            s, e, t = (int(v) for v in t5.samples_mapping[i])
            return ref.t5_sample([indexed[j].tolist() for j in range(s, e)], t, 512, 128, t5.vocab_id_list,
                                 t5.vocab_id_to_token_dict, t5.cls_id, t5.sep_id, t5.mask_id, t5.pad_id, 0.15, 1234,
                                 i, t5.bos_id, t5.eos_id, t5.sentinel_tokens)
        want, t_ref = timed(lambda: [t5_ref(i) for i in range(n)])
        assert all(np.array_equal(t5[i][k], want[i][k]) for i in range(n) for k in want[i])
        print(f"T5 samples (512/128): ours {n / t_ours:.0f}/s ({t_ours / n * 1e3:.2f} ms) vs Megatron-shaped "
              f"reference {n / t_ref:.0f}/s -> {t_ref / t_ours:.2f}x; equal")


if __name__ == "__main__":
    main()
