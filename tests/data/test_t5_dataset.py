"""T5 dataset: samples equal a literal re-implementation of Megatron's span corruption (BERT WordPiece with extra ids
and SentencePiece), field invariants, sentinel order, span statistics, the one-line errors and the builder."""
from __future__ import annotations

import numpy as np
import pytest

from megatron.data.dataset_utils import DatasetError
from megatron.data.indexed_dataset import make_dataset
from megatron.data.t5_dataset import T5Dataset, build_train_valid_test_datasets
from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from tests.data import megatron_data_reference as ref
from tests.data.test_bert_dataset import preprocess

ENC, DEC = 128, 48


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("t5")
    spm = str(shared_data / "t5-sentencepiece" / "spiece.model")
    return {
        "sentences": preprocess(shared_data, out, "owt", 30, "--split-sentences"),
        "documents": preprocess(shared_data, out, "docs", 30),
        "spm_sentences": _preprocess_spm(shared_data, out, spm),
    }


def _preprocess_spm(shared_data, out, spm):
    from megatron.data import preprocessing

    src = out / "spm.jsonl"
    with open(shared_data / "openwebtext-1000" / "openwebtext-1000.jsonl", encoding="utf-8") as f:
        src.write_text("".join(f.readline() for _ in range(20)), encoding="utf-8")
    argv = ["--input", str(src), "--output-prefix", str(out / "spm"), "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", spm, "--split-sentences"]
    assert preprocessing.main(preprocessing.run, argv) == 0
    return str(out / "spm_text_sentence")


@pytest.fixture(scope="module")
def bert_tok(shared_data):
    return BertWordPieceTokenizer(str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt"),
                                  vocab_extra_ids=100)


@pytest.fixture(scope="module")
def spm_tok(shared_data):
    return SentencePieceTokenizer(str(shared_data / "t5-sentencepiece" / "spiece.model"), vocab_extra_ids=100)


def make(prefix, tokenizer, *, num_samples=200, seed=1234, enc=ENC, dec=DEC, name="train") -> T5Dataset:
    indexed = make_dataset(prefix, "mmap", True)
    return T5Dataset(name, indexed, prefix, None, num_samples, 0.15, enc, dec, 0.1, seed, tokenizer=tokenizer)


def reference(ds: T5Dataset, idx: int) -> dict:
    start, end, target = (int(v) for v in ds.samples_mapping[idx])
    sentences = [ds.indexed_dataset[i].tolist() for i in range(start, end)]
    return ref.t5_sample(sentences, target, ds.max_seq_length, ds.max_seq_length_dec, ds.vocab_id_list,
                         ds.vocab_id_to_token_dict, ds.cls_id, ds.sep_id, ds.mask_id, ds.pad_id, ds.masked_lm_prob,
                         ds.seed, idx, ds.bos_id, ds.eos_id, ds.sentinel_tokens)


def test_tokenizers_have_ascending_sentinels(bert_tok, spm_tok):
    for tok in (bert_tok, spm_tok):
        ids = tok.additional_special_tokens_ids
        assert len(ids) == 100 and ids == list(range(ids[0], ids[0] + 100))
        assert [tok.inv_vocab[i] for i in (ids[0], ids[-1])] == ["<extra_id_0>", "<extra_id_99>"]
        assert tok.pad == 0 and ids[0] > max(tok.bos, tok.eos)  # after [BOS]/[EOS], as Megatron appends them


@pytest.mark.parametrize("which", ["bert_sentences", "bert_documents", "spm_sentences"])
def test_samples_equal_megatron_reference(data, bert_tok, spm_tok, which):
    prefix = {"bert_sentences": data["sentences"], "bert_documents": data["documents"],
              "spm_sentences": data["spm_sentences"]}[which]
    ds = make(prefix, spm_tok if which.startswith("spm") else bert_tok)
    assert len(ds) >= 200
    truncated = 0
    for idx in range(len(ds)):
        got, want = ds[idx], reference(ds, idx)
        assert set(got) == set(want)
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value, err_msg=f"{which} sample {idx} field {key}")
        truncated += got["truncated"]
    assert got["enc_mask"].shape == (ENC, ENC) and got["dec_mask"].shape == (DEC, DEC)
    assert got["enc_dec_mask"].shape == (DEC, ENC) and got["text_enc"].dtype == np.int64
    if which == "bert_documents":
        assert truncated > 0


def test_span_corruption_invariants(data, bert_tok):
    ds = make(data["sentences"], bert_tok)
    sentinels = ds.sentinel_tokens
    for idx in range(len(ds)):
        s = ds[idx]
        enc, dec, labels, loss = s["text_enc"], s["text_dec"], s["labels"], s["loss_mask"]
        n_dec = int(loss.sum())
        assert np.all(loss[:n_dec] == 1) and np.all(labels[n_dec:] == -1) and np.all(dec[n_dec:] == 0)
        assert dec[0] == bert_tok.bos and labels[n_dec - 1] == bert_tok.eos
        np.testing.assert_array_equal(dec[1:n_dec], labels[:n_dec - 1])  # decoder input = output shifted right
        enc_list = enc[enc != 0].tolist()
        used = [t for t in enc_list if t in sentinels]
        k = len(used)
        assert used == sentinels[:k] and [t for t in dec[:n_dec] if t in sentinels] == used  # in order, once each
        # re-inserting each sentinel's span gives back the (truncated) original text
        spans, current = {}, None
        for t in labels[:n_dec - 1].tolist():
            if t in sentinels:
                current = t
                spans[t] = []
            else:
                spans[current].append(t)
        rebuilt = [x for t in enc_list for x in (spans[t] if t in sentinels else [t])]
        start, end, target = (int(v) for v in ds.samples_mapping[idx])
        original = [t for i in range(start, end) for t in ds.indexed_dataset[i].tolist()][:target]
        assert rebuilt == original
        assert all(len(v) > 0 for v in spans.values())
        valid_enc, valid_dec = enc != 0, dec != 0
        np.testing.assert_array_equal(s["enc_mask"], np.outer(valid_enc, valid_enc))
        np.testing.assert_array_equal(s["enc_dec_mask"], np.outer(valid_dec, valid_enc))
        np.testing.assert_array_equal(s["dec_mask"], np.outer(valid_dec, valid_dec) * np.tri(DEC, dtype=np.int64))


def test_span_statistics(data, bert_tok):
    """~15% of the tokens go to the decoder, in whole-word spans of min(Geometric(0.2), 10) words, shortened only to
    fit the budget: 1-word spans most common, none over 10 words."""
    ds = make(data["sentences"], bert_tok, num_samples=1500, enc=256, dec=96)
    inv = bert_tok.inv_vocab
    masked = total = 0
    words = []
    for idx in range(1500):
        s = ds[idx]
        n_dec = int(s["loss_mask"].sum())
        spans, cur = [], None
        for t in s["labels"][:n_dec - 1].tolist():
            if t in ds.sentinel_tokens:
                cur = []
                spans.append(cur)
            else:
                cur.append(t)
        in_spans = sum(len(sp) for sp in spans)
        masked += in_spans
        total += int((s["text_enc"] != 0).sum()) - len(spans) + in_spans  # one sentinel per span in the encoder
        words += [sum(not inv[t].startswith("##") for t in sp) for sp in spans]
    frac = masked / total
    hist = np.bincount(words, minlength=12)
    print(f"T5: {frac:.4f} of the tokens masked; span words 1..10: {(hist[1:11] / len(words)).round(3).tolist()}")
    assert 0.13 <= frac <= 0.16, frac
    assert hist[11:].sum() == 0 and hist[0] == 0 and hist[1] == hist.max() and hist[6:11].sum() > 0
    assert 2.0 < np.mean(words) < 4.5
    decay = hist[2:9] / hist[1:8]  # Geometric(0.2): each length 0.8 times as likely as the one before
    assert np.all((decay > 0.6) & (decay < 0.9)), decay


def test_one_line_errors(data, bert_tok, shared_data):
    ds = make(data["sentences"], bert_tok, dec=8)
    with pytest.raises(DatasetError) as err:
        for idx in range(len(ds)):
            ds[idx]
    assert "--decoder-seq-length" in str(err.value) and "\n" not in str(err.value)
    few = BertWordPieceTokenizer(str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt"),
                                 vocab_extra_ids=2)
    ds = make(data["sentences"], few)
    with pytest.raises(DatasetError) as err:
        for idx in range(len(ds)):
            ds[idx]
    assert "--vocab-extra-ids" in str(err.value) and "\n" not in str(err.value)
    none = BertWordPieceTokenizer(str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt"))
    with pytest.raises(DatasetError, match="--vocab-extra-ids 100"):
        make(data["sentences"], none)
    from megatron.tokenizer.null_tokenizer import NullTokenizer

    class NullWithSentinels(NullTokenizer):
        additional_special_tokens_ids = [5, 6]

    with pytest.raises(DatasetError, match="T5 needs a tokenizer with a pad token"):
        make(data["sentences"], NullWithSentinels(100))


def test_determinism_and_builder(data, bert_tok):
    a, b = make(data["sentences"], bert_tok), make(data["sentences"], bert_tok)
    for idx in (0, 11, 11, 150):
        for key in a[idx]:
            np.testing.assert_array_equal(a[idx][key], b[idx][key])
    train, valid, test = build_train_valid_test_datasets([data["documents"]], "mmap", "90,10,0", [50, 5, 0], ENC,
                                                         DEC, 0.15, 0.1, 1234, True, tokenizer=bert_tok)
    assert test is None and len(train) >= 50 and len(valid) >= 5
    rows = np.asarray(valid.samples_mapping)
    docs = make_dataset(data["documents"], "mmap", True).doc_idx
    assert rows[:, 0].min() >= docs[27] and rows[:, 1].max() <= docs[30]
    assert set(valid[0]) == {"text_enc", "text_dec", "labels", "loss_mask", "truncated", "enc_mask", "dec_mask",
                             "enc_dec_mask"}
