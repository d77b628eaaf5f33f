"""Finetuning data: the MNLI / QQP / RACE parsers on the shipped samples (train, dev and test-format headers,
malformed rows skipped with a counted warning naming file and line, a file with no usable rows a one-line error),
Megatron's text cleaning, the [CLS] a [SEP] b [SEP] layout with token types / padding / truncation, dataset names.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from tasks.data_utils import TaskDataError, build_tokens_types_paddings_from_ids, clean_text, dataset_name
from tasks.glue import mnli, qqp
from tasks.race import data as race

SEQ = 64


@pytest.fixture(scope="module")
def tok(shared_data: Path) -> BertWordPieceTokenizer:
    return BertWordPieceTokenizer(str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt"))


def _tsv_rows(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()[1:]]


def test_mnli_train_dev_and_test_files(shared_data: Path, tok: BertWordPieceTokenizer) -> None:
    d = shared_data / "mnli-sample"
    train = mnli.build_dataset([str(d / "train.tsv")], tok, SEQ)
    rows = _tsv_rows(d / "train.tsv")
    assert len(train) == len(rows) == 6 and train.dataset_name == "train"
    assert [s["label"] for s in train] == [mnli.LABELS[r[-1]] for r in rows] == [2, 1, 1, 1, 2, 0]
    assert [s["uid"] for s in train] == [int(r[0]) for r in rows]
    first = train[0]
    expect = [tok.cls, *tok.tokenize(clean_text(rows[0][8])), tok.sep, *tok.tokenize(clean_text(rows[0][9])), tok.sep]
    n = len(expect)
    assert first["text"][:n].tolist() == expect and (first["text"][n:] == tok.pad).all()
    a_len = len(tok.tokenize(clean_text(rows[0][8]))) + 2
    assert first["types"][:n].tolist() == [0] * a_len + [1] * (n - a_len)
    assert first["padding_mask"].tolist() == [1] * n + [0] * (SEQ - n)

    dev = mnli.build_dataset([str(d / "dev_matched.tsv")], tok, SEQ)
    assert dev.dataset_name == "dev-matched" and len(dev) == 5
    assert [s["label"] for s in dev] == [mnli.LABELS[r[-1]] for r in _tsv_rows(d / "dev_matched.tsv")]
    test = mnli.build_dataset([str(d / "test_matched.tsv")], tok, SEQ)  # 10-column header: no labels
    assert test.dataset_name == "test-matched" and len(test) == 5
    assert {s["label"] for s in test} == {0} and [s["uid"] for s in test] == [0, 1, 2, 3, 4]
    assert dataset_name("/data/glue/MNLI/dev_mismatched.tsv", "MNLI") == "dev-mismatched"


def test_malformed_rows_are_counted_and_an_empty_file_is_one_line(shared_data: Path, tok: BertWordPieceTokenizer,
                                                                  tmp_path: Path, capsys: pytest.CaptureFixture
                                                                  ) -> None:
    lines = (shared_data / "mnli-sample" / "train.tsv").read_text(encoding="utf-8").splitlines()
    bad_label = lines[2].rsplit("\t", 1)[0] + "\tmaybe"
    path = tmp_path / "MNLI" / "train.tsv"
    path.parent.mkdir()
    path.write_text("\n".join([lines[0], lines[1], "7\tshort row", bad_label, lines[3]]) + "\n", encoding="utf-8")
    ds = mnli.build_dataset([str(path)], tok, SEQ)
    out = capsys.readouterr().out
    assert len(ds) == 2
    assert f"{path}:3: index error" in out and f"{path}:4: index error" in out and "'maybe'" in out
    assert f"{path}: skipped 2 malformed row(s), kept 2" in out
    empty = tmp_path / "MNLI" / "dev_matched.tsv"
    empty.write_text(lines[0] + "\n" + "1\tx\n", encoding="utf-8")
    with pytest.raises(TaskDataError) as info:
        mnli.build_dataset([str(empty)], tok, SEQ)
    assert str(empty) in str(info.value) and "no usable rows" in str(info.value) and "\n" not in str(info.value)


def test_qqp_six_and_three_column_files(tmp_path: Path, tok: BertWordPieceTokenizer,
                                        capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "QQP"
    d.mkdir()
    (d / "dev.tsv").write_text(
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
        "10\t1\t2\tHow do I learn Python ?\tWhat is the best way to learn Python ?\t1\n"
        "11\t3\t4\tWhy is the sky blue ?\tHow tall is Everest ?\t0\n"
        "12\t5\t6\tA question without a pair\t\t0\n"
        "13\t7\t8\tBroken row\n", encoding="utf-8")
    (d / "test.tsv").write_text("id\tquestion1\tquestion2\n0\tIs it raining ?\tWill it rain today ?\n",
                                encoding="utf-8")
    dev = qqp.build_dataset([str(d / "dev.tsv")], tok, SEQ)
    out = capsys.readouterr().out
    assert dev.dataset_name == "dev" and [(s["uid"], s["label"]) for s in dev] == [(10, 1), (11, 0)]
    assert "dev.tsv:4: zero length b" in out and "dev.tsv:5: index error" in out
    test = qqp.build_dataset([str(d / "test.tsv")], tok, SEQ)
    assert test.dataset_name == "test" and [(s["uid"], s["label"]) for s in test] == [(0, 0)]
    a, b = tok.tokenize("Is it raining ?"), tok.tokenize("Will it rain today ?")
    assert test[0]["text"][:len(a) + len(b) + 3].tolist() == [tok.cls, *a, tok.sep, *b, tok.sep]


def test_cleaning_and_truncation() -> None:
    assert clean_text("a  b\n\tc . d . e . f") == "a b c. d. e. f"
    ids, types, pads = build_tokens_types_paddings_from_ids([5, 6], [7, 8, 9, 10], 6, 101, 102, 0)
    assert ids == [101, 5, 6, 102, 7, 102] and types == [0, 0, 0, 0, 1, 1] and pads == [1] * 6  # b cut first
    ids, types, pads = build_tokens_types_paddings_from_ids([5, 6], None, 8, 101, 102, 0)
    assert ids == [101, 5, 6, 102, 0, 0, 0, 0] and types == [0] * 8 and pads == [1, 1, 1, 1, 0, 0, 0, 0]


def test_race_directories(shared_data: Path, tok: BertWordPieceTokenizer, tmp_path: Path,
                          capsys: pytest.CaptureFixture) -> None:
    root = shared_data / "race-sample" / "RACE"
    train = race.build_dataset([str(root / "train" / "middle"), str(root / "train" / "high")], tok, SEQ)
    assert train.dataset_name == "train-middle" and len(train) == 12 and train.sample_multiplier == 4
    docs = [json.loads((root / "train" / lvl / f"{i}.txt").read_text()) for lvl in ("middle", "high") for i in (1, 2)]
    assert [s["label"] for s in train] == ["ABCD".index(a) for d in docs for a in d["answers"]]
    assert [s["uid"] for s in train] == list(range(12))
    assert train[0]["text"].shape == (4, SEQ)
    # the cloze question of train/middle/2.txt: "_" filled by each option; the article is the (cut) second segment
    doc, q = docs[1], docs[1]["questions"].index("The pupils watered the garden  _  .")
    sample = train[3 + q]
    for k, option in enumerate(doc["options"][q]):
        qa = tok.tokenize(clean_text(doc["questions"][q].replace("_", option)))
        row = sample["text"][k].tolist()
        assert row[:len(qa) + 2] == [tok.cls, *qa, tok.sep]
        assert row[-1] == tok.sep and sample["padding_mask"][k].all()  # the article was truncated to fit
        article = tok.tokenize(clean_text(doc["article"]))
        assert row[len(qa) + 2:-1] == article[:SEQ - len(qa) - 3]
    plain = docs[0]["questions"][0] + " " + docs[0]["options"][0][1]
    assert train[0]["text"][1].tolist()[1:len(tok.tokenize(plain)) + 1] == tok.tokenize(plain)
    assert race.build_dataset([str(root / "dev" / "high")], tok, SEQ).dataset_name == "dev-high"

    bad = tmp_path / "RACE" / "dev" / "middle"
    bad.mkdir(parents=True)
    good = json.loads((root / "dev" / "middle" / "1.txt").read_text())
    good["options"][1] = good["options"][1][:3]  # 3 options: that question is skipped
    (bad / "1.txt").write_text(json.dumps(good) + "\nnot json\n", encoding="utf-8")
    ds = race.build_dataset([str(bad)], tok, SEQ)
    out = capsys.readouterr().out
    assert len(ds) == 1 and f"{bad / '1.txt'}:1: question 1" in out and f"{bad / '1.txt'}:2: not a RACE JSON" in out
    assert f"{bad / '1.txt'}: skipped 2 malformed row(s), kept 1" in out
    (tmp_path / "2.txt").write_text("not json\n", encoding="utf-8")
    with pytest.raises(TaskDataError, match="2.txt: no usable rows"):
        race.build_dataset([str(tmp_path / "2.txt")], tok, SEQ)


@pytest.mark.parametrize("task, name", [(mnli, "train.tsv"), (mnli, "dev_matched.tsv"), (mnli, "test_matched.tsv")])
def test_a_file_without_its_header_keeps_its_first_row(shared_data: Path, tok: BertWordPieceTokenizer,
                                                       tmp_path: Path, capsys: pytest.CaptureFixture,
                                                       task, name: str) -> None:
    """Megatron's reader skips line 1 as the header; a file without one used to lose its first row silently."""
    src = shared_data / "mnli-sample" / name
    lines = src.read_text(encoding="utf-8").splitlines()
    headless = tmp_path / name
    headless.write_text("\n".join(lines[1:]) + "\n", encoding="utf-8")
    full = task.build_dataset([str(src)], tok, SEQ)
    capsys.readouterr()
    kept = task.build_dataset([str(headless)], tok, SEQ)
    assert [s["uid"] for s in kept] == [s["uid"] for s in full] and len(kept) == len(lines) - 1
    assert [s["label"] for s in kept] == [s["label"] for s in full]
    assert kept.has_labels == full.has_labels
    assert capsys.readouterr().out.strip() == (f"note: {headless} has no header row (its first line is a data row, "
                                               f"uid {lines[1].split(chr(9))[0]}); reading it as data")


def test_qqp_file_without_its_header_keeps_its_first_row(tok: BertWordPieceTokenizer, tmp_path: Path) -> None:
    path = tmp_path / "train.tsv"
    path.write_text("5\t1\t2\tWhat is a cat?\tWhat is a dog?\t0\n6\t3\t4\tHow old?\tWhat age?\t1\n", encoding="utf-8")
    data = qqp.build_dataset([str(path)], tok, SEQ, verbose=False)
    assert [(s["uid"], s["label"]) for s in data] == [(5, 0), (6, 1)]
