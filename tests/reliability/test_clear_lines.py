"""Inputs that used to end in a traceback or a silent oddity now give one clear line, or are repaired (issue 30,
"Make these one clear line"). Each test is named after the input it protects against."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def test_truncated_index_cache_npy_is_named_and_rebuilt(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megatron.data.gpt_dataset import _build_index_mappings

    sizes = np.full(20, 50, dtype=np.int32)
    documents = np.arange(20, dtype=np.int32)

    def build() -> tuple:
        return _build_index_mappings("train", str(tmp_path / "corpus"), documents, sizes, "100,0,0", 30, 16, 1234,
                                     data_cache_path=str(tmp_path / "cache"), synchronize=False)

    doc_idx, sample_idx, shuffle_idx, _, desc_hash = build()
    want = [np.array(a) for a in (doc_idx, sample_idx, shuffle_idx)]
    damaged = tmp_path / "cache" / f"{desc_hash}_sample_idx.npy"
    damaged.write_bytes(damaged.read_bytes()[:-40])  # truncated outside our atomic writes
    capsys.readouterr()
    again = build()
    out = capsys.readouterr().out
    assert f"index cache file {damaged} is damaged" in out and "rebuilding it" in out, out
    assert all(np.array_equal(np.array(a), b) for a, b in zip(again[:3], want))
    damaged.write_bytes(b"\x93NUMPY")  # even the header cut short
    assert all(np.array_equal(np.array(a), b) for a, b in zip(build()[:3], want))


def test_truncated_samples_mapping_npy_is_rebuilt(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megatron.data.dataset_utils import get_samples_mapping
    from tests.data.test_samples_mapping import _corpus

    prefix, ds = _corpus(tmp_path)
    want = np.array(get_samples_mapping(ds, prefix, None, 40, 61, 0.1, 1234, "train", True))
    path = tmp_path / "c_text_sentence_train_indexmap_40mns_61msl_0.10ssp_1234s.npy"
    path.write_bytes(path.read_bytes()[:100])
    capsys.readouterr()
    got = get_samples_mapping(ds, prefix, None, 40, 61, 0.1, 1234, "train", True)
    assert f"index cache file {path} is damaged" in capsys.readouterr().out
    np.testing.assert_array_equal(got, want)


def test_non_utf8_tracker_file_is_one_line(tmp_path: Path) -> None:
    from megatron.checkpoint.conversion.megatron_format import find_iteration_dir
    from megatron.compat import read_metadata
    from megatron.errors import MegatronUserError

    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(b"\xff\xfe4\x00")
    for read in (lambda: read_metadata(str(tracker)), lambda: find_iteration_dir(str(tmp_path))):
        with pytest.raises(MegatronUserError) as exc:
            read()
        assert "\n" not in str(exc.value) and f"{tracker} is not text (byte 0xff at offset 0" in str(exc.value)
    (tmp_path / "latest").write_bytes(b"global_step\x80")
    from megatron.checkpoint.conversion.deepspeed_format import resolve_tag_dir

    with pytest.raises(MegatronUserError, match="latest is not text .byte 0x80 at offset 11"):
        resolve_tag_dir(str(tmp_path))


def test_truncated_safetensors_in_convert_is_named(tmp_path: Path) -> None:
    import transformers

    from megatron.checkpoint.conversion import driver
    from megatron.checkpoint.conversion.interchange import ConversionError

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(tmp_path / "hf"))
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConversionError) as exc:
        driver.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir", str(tmp_path / "hf"),
                     "--save-dir", str(tmp_path / "out")])
    assert "\n" not in str(exc.value) and f"{weights} is not a readable safetensors file" in str(exc.value)
    assert "truncated or damaged" in str(exc.value) and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_full_disk_during_save_is_one_line_and_keeps_the_last_checkpoint(tiny_data: dict, tmp_path: Path) -> None:
    from megatron.checkpoint.atomic_io import FAULT_ENV
    from tests.reliability.helpers import assert_one_line_error, run, train_argv

    proc = run("pretrain_gpt.py", *train_argv(tiny_data, "--save", "ckpt", "--save-interval", "2", iters=4),
               cwd=tmp_path, env={FAULT_ENV: "mid-write:model_optim_rng.pt@2!enospc"})  # the second save's file
    assert_one_line_error(proc, "no space left on the device holding ckpt/iter_0000004/mp_rank_00",
                          "model_optim_rng.pt was not published")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not list((tmp_path / "ckpt").rglob("*.tmp.*"))
    assert not (tmp_path / "ckpt" / "iter_0000004" / "manifest.json").exists()


def test_full_disk_during_convert_is_one_line_and_publishes_nothing(tiny_ckpt: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.checkpoint import atomic_io
    from megatron.checkpoint.conversion import driver
    from megatron.errors import MegatronUserError

    monkeypatch.setenv(atomic_io.FAULT_ENV, "mid-write:model_optim_rng.pt@1!enospc")
    monkeypatch.setitem(atomic_io._fault_hits, "n", 0)
    with pytest.raises(MegatronUserError) as exc:
        driver.main(["--model-type", "GPT", "--load-dir", str(tiny_ckpt), "--save-dir", str(tmp_path / "out")])
    assert str(exc.value) == (f"no space left on the device holding {tmp_path} while converting into "
                              f"{tmp_path / 'out'}: free space or choose another --save-dir; nothing was written there")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_stale_converting_folder_is_removed_on_the_next_run(tiny_ckpt: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    import subprocess
    import sys

    from megatron.checkpoint.conversion import driver

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.converting.{int(gone.stdout)}"  # left by a conversion that was SIGKILLed
    (stale / "iter_0000002").mkdir(parents=True)
    other = tmp_path / f".other.converting.{int(gone.stdout)}"  # another target's: not ours to judge
    other.mkdir()
    driver.main(["--model-type", "GPT", "--load-dir", str(tiny_ckpt), "--save-dir", str(tmp_path / "out")])
    assert "removed 1 unfinished conversion folder(s) of interrupted runs" in capsys.readouterr().out
    assert not stale.exists() and other.exists() and (tmp_path / "out" / "iter_0000002").is_dir()


@pytest.fixture(scope="module")
def bert_tok(shared_data: Path):
    from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

    return BertWordPieceTokenizer(str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt"))


def test_binary_mnli_tsv_is_one_line(shared_data: Path, bert_tok, tmp_path: Path) -> None:
    from tasks.data_utils import TaskDataError
    from tasks.glue import mnli

    good = (shared_data / "mnli-sample").rglob("*.tsv").__next__().read_bytes()
    binary = tmp_path / "dev_matched.tsv"
    binary.write_bytes(good[:300] + bytes(range(128, 256)) * 4)  # e.g. a gzip file under the .tsv name
    with pytest.raises(TaskDataError) as exc:
        mnli.build_dataset([str(binary)], bert_tok, 32, verbose=False)
    assert "\n" not in str(exc.value) and f"{binary}: not UTF-8 text near line" in str(exc.value)


def test_race_dev_folder_without_files_is_one_line(bert_tok, tmp_path: Path) -> None:
    from tasks.data_utils import TaskDataError
    from tasks.race import data as race

    (tmp_path / "RACE" / "dev" / "middle").mkdir(parents=True)  # unpacked somewhere else: no *.txt here
    with pytest.raises(TaskDataError, match=r"dev/middle: no \*.txt files in this folder .*--valid-data"):
        race.build_dataset([str(tmp_path / "RACE" / "dev" / "middle")], bert_tok, 32, verbose=False)


def _sentences(prefix: str, docs: list, vocab_size: int) -> None:
    from megatron.data.indexed_dataset import make_builder

    builder = make_builder(prefix + ".bin", impl="mmap", vocab_size=vocab_size)
    for doc in docs:
        for sentence in doc:
            builder.add_item(np.asarray(sentence, dtype=np.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def t5_tok(shared_data: Path):
    from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

    return BertWordPieceTokenizer(str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt"),
                                  vocab_extra_ids=100)


def test_t5_zero_length_sentences_and_no_samples_are_one_line(t5_tok, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    from megatron.data.dataset_utils import DatasetError
    from megatron.data.indexed_dataset import make_dataset
    from megatron.data.t5_dataset import T5Dataset

    def t5(prefix: str) -> T5Dataset:
        return T5Dataset("train", make_dataset(prefix, "mmap", True), prefix, None, 20, 0.15, 64, 32, 0.1, 1234,
                         tokenizer=t5_tok)

    empty = str(tmp_path / "empty_text_sentence")
    _sentences(empty, [[[], []] for _ in range(5)], t5_tok.vocab_size)  # preprocessing of an empty text field
    with pytest.raises(DatasetError, match="all 5 document.s. hold only zero-length sentences: no T5 sample"):
        t5(empty)
    nothing = str(tmp_path / "nothing_text_sentence")
    _sentences(nothing, [], t5_tok.vocab_size)
    with pytest.raises(DatasetError, match="no sentences in its documents: no T5 sample can be built"):
        t5(nothing)
    some = str(tmp_path / "some_text_sentence")
    _sentences(some, [[[5, 6, 7], [8, 9]], [[]], [[10, 11], [], [12]]], t5_tok.vocab_size)
    capsys.readouterr()
    ds = t5(some)
    assert "1 of 3 documents hold only zero-length sentences" in capsys.readouterr().out
    assert len(ds) >= 20 and ds[0]["loss_mask"].sum() > 0


def test_random_seed_beyond_64_bits_is_a_400_line() -> None:
    from megatron.text_generation.server import BadRequest, validate_request

    def check(seed: int) -> dict:
        return validate_request({"prompts": ["a"], "random_seed": seed, "tokens_to_generate": 4},
                                count_tokens=lambda text: len(text.split()),
                                max_sequence_length=64)

    for seed in (2**64, 2**63, -2):  # 2**64 was "Overflow when unpacking long long" from the generator
        with pytest.raises(BadRequest, match=r"random_seed must be between 0 and 2\*\*63-1 .*or -1 for none; got"):
            check(seed)
    assert check(2**63 - 1)["options"]["random_seed"] == 2**63 - 1


@pytest.mark.slow
def test_bert_vocab_without_cls_sep_mask_is_one_line_without_traceback(shared_data: Path, tmp_path: Path) -> None:
    from tests.reliability.helpers import MODEL, assert_one_line_error, run

    words = (shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt").read_text(encoding="utf-8").splitlines()
    (tmp_path / "vocab.txt").write_text("\n".join(w for w in words if w not in ("[CLS]", "[SEP]", "[MASK]")) + "\n",
                                        encoding="utf-8")
    proc = run("pretrain_bert.py", *MODEL, "--vocab-file", "vocab.txt", "--tokenizer-type", "BertWordPieceLowerCase",
               "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-4", "--data-path", "none",
               cwd=tmp_path)
    assert_one_line_error(proc, "--vocab-file vocab.txt: missing [CLS], [SEP], [MASK]; is this a BERT WordPiece")


def test_bert_empty_sentences_are_one_line_naming_the_document(t5_tok, tmp_path: Path) -> None:
    """Zero-length sentences used to stop BERT at some sample with a bare `AssertionError` (segment A empty)."""
    from megatron.data.bert_dataset import BertDataset
    from megatron.data.dataset_utils import DatasetError
    from megatron.data.indexed_dataset import make_dataset

    def bert(prefix: str) -> BertDataset:
        return BertDataset("train", make_dataset(prefix, "mmap", True), prefix, None, 20, 0.15, 32, 0.1, 1234, True,
                           tokenizer=t5_tok, synchronize=False)

    docs = [[[1000 + d, 1001, 1002], [1003, 1004]] for d in range(6)]
    good = str(tmp_path / "good_text_sentence")
    _sentences(good, docs, t5_tok.vocab_size)
    assert len(bert(good)) > 0
    bad = str(tmp_path / "bad_text_sentence")
    _sentences(bad, docs[:3] + [[[], [1005, 1006]]] + docs[3:], t5_tok.vocab_size)
    with pytest.raises(DatasetError) as info:
        bert(bad)
    assert str(info.value) == (f"--data-path {bad} (train split): 1 sentence(s) hold no tokens, the first in document "
                               f"3 of the split (sentence 6 of {bad}.bin); BERT samples need non-empty sentences: "
                               "preprocess again with tools/preprocess_data.py --split-sentences (it drops empty "
                               "sentences)")
