"""megatron/data/sft_dataset.py (`--sft`): samples equal Megatron-LM's own SFTDataset (core_v0.16.1, oracle
subprocess: tests/data/sft_oracle.py) on the shipped chat sample, with its split and blend rules; truncation; bad
lines named by file and line."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.data.sft_dataset import SFTBuilder, SFTLineError, SFTLowLevelDataset, split_matrix
from megatron.tokenizer.chat_format import IGNORE_INDEX, ChatFormat
from tests.data.sft_oracle import megatron_sft_samples
from tests.tokenizer.chat_files import write_chat_tokenizer

transformers = pytest.importorskip("transformers")
SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "chat_sample.jsonl"
KEYS = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, shared_data: Path) -> Path:
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"), shared_data)


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


def _ours(datasets) -> dict:
    return {name: [{k: ds[i][k].tolist() for k in KEYS} for i in range(len(ds))]
            for name, ds in zip(("train", "valid", "test"), datasets) if ds is not None}


def _assert_same(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert len(ours[name]) == len(theirs[name]), name
        for i, (a, b) in enumerate(zip(ours[name], theirs[name])):
            for k in KEYS:
                assert a[k] == b[k], (name, i, k)


CASES = {  # name: (prompt format, seq_length, sizes, cp, --data-path / per-split paths, --split)
    "split": ("nemotron-h-aligned", 320, [190, 17, 3], 1, "one", "90,8,2"),  # 190 > 180 lines: the order wraps
    "cp2": ("nemotron-nano-v2", 320, [30, 4, 2], 2, "one", "90,8,2"),
    "blend": ("nemotron-h-aligned", 320, [40, 6, 0], 1, "blend", "80,20,0"),
    "per_split": ("nemotron-h-aligned", 320, [12, 5, 0], 1, "per_split", None),
}


def _paths(kind: str, folder: Path):
    lines = SAMPLE.read_text().splitlines()
    a, b = folder / "a.jsonl", folder / "b.jsonl"
    a.write_text("\n".join(lines[:120]) + "\n")
    b.write_text("\n".join(lines[120:]) + "\n")
    if kind == "one":
        return dict(blend=[[str(SAMPLE)], None]), ([str(SAMPLE)], None)
    if kind == "blend":
        return dict(blend=[[str(a), str(b)], [0.3, 0.7]]), (["0.3", str(a), "0.7", str(b)], None)
    return dict(blend_per_split=[[[str(a)], None], [[str(b)], None], None]), (None, ([str(a)], [str(b)], None))


@pytest.fixture(scope="module")
def megatron_samples(tmp_path_factory, tok_dir) -> dict:
    """Every case through Megatron-LM's SFTDataset in one oracle subprocess."""
    folder = tmp_path_factory.mktemp("sft_oracle")
    configs = {}
    for name, (fmt, seq, sizes, cp, kind, split) in CASES.items():
        theirs, _ = _paths(kind, folder)
        configs[name] = dict(prompt_format=fmt, seq_length=seq, sizes=sizes, cp=cp, split=split, **theirs)
    return megatron_sft_samples(folder, tok_dir, configs), folder


@pytest.mark.parametrize("case", list(CASES))
def test_samples_equal_megatron_sft_dataset(megatron_samples, tok, case):
    """Every sample's tokens, labels, loss mask, positions, cu_seqlens and max_seqlen, in Megatron's order."""
    results, folder = megatron_samples
    fmt, seq, sizes, cp, kind, split = CASES[case]
    _, (data_path, per_split) = _paths(kind, folder)
    ours = SFTBuilder(ChatFormat(tok, fmt), seq, cp).build(sizes, data_path, split, per_split or (None,) * 3)
    _assert_same(_ours(ours), results[case])
    if cp > 1:  # each conversation but the last (which ends at the padded end) fills a multiple of 2 x CP
        bounds = [s["cu_seqlens"] for s in results[case]["train"]]
        assert any(len(c) > 2 for c in bounds)
        assert all(np.all(np.diff(c[:-1]) % (2 * cp) == 0) for c in bounds)


def test_truncation_keeps_seq_length_and_the_last_position_is_a_pad(tok):
    fmt = ChatFormat(tok, "hf")
    ds = SFTBuilder(fmt, 48).build([200, 0, 0], [str(SAMPLE)], "1,0,0")[0]
    low = SFTLowLevelDataset(str(SAMPLE))
    line = next(i for i, m in enumerate(low.messages) if len(fmt.render(m[:3])[0]) > 60)
    sample = ds[line]
    full, mask = fmt.render(low.messages[line][:3])
    assert sample["tokens"].tolist() == full[:48]
    assert sample["labels"].tolist()[:47] == [t if m else IGNORE_INDEX for t, m in zip(full[1:48], mask[1:48])]
    assert sample["labels"][47] == fmt.pad and sample["loss_mask"][47] == 0
    assert sample["cu_seqlens"].tolist() == [0, 48] and sample["max_seqlen"] == 48
    assert sample["position_ids"].tolist() == list(range(48))


def test_loss_mask_is_the_assistant_targets_shifted(tok):
    fmt = ChatFormat(tok, "nemotron-h-aligned")  # its pad (<SPECIAL_233>) is not the EOD
    sample = SFTBuilder(fmt, 320).build([1, 0, 0], [str(SAMPLE)], "1,0,0")[0][0]
    first = SFTLowLevelDataset(str(SAMPLE)).messages[0][:3]
    tokens, mask = fmt.render(first)
    n = len(tokens)
    assert sample["tokens"][:n].tolist() == tokens and sample["tokens"][n] == fmt.eod
    assert sample["loss_mask"][:n - 1].tolist() == [float(m) for m in mask[1:]]
    assert sample["loss_mask"][n - 1] == 1.0  # the EOD after the conversation is a target, as in Megatron
    assert sample["position_ids"][n + 1] == 0  # the next conversation restarts its positions
    hf = ChatFormat(tok, "hf")  # GPT-2 has no pad: the pad is the EOD, so the EOD gets no loss (Megatron's rule)
    assert hf.pad == hf.eod and SFTBuilder(hf, 320).build([1, 0, 0], [str(SAMPLE)], "1,0,0")[0][0]["loss_mask"][
        len(hf.render(first)[0]) - 1] == 0.0
    assert sample["tokens"].dtype == torch.int64 and sample["cu_seqlens"].dtype == torch.int32


@pytest.mark.parametrize("line, words", [
    ("not json", "x.jsonl:2: not JSON"),
    ('{"text": "hi"}', "x.jsonl:2: no 'messages' key"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}',
     "x.jsonl:2: message 1 has role 'bot'"),
    ('{"messages": [{"content": "q"}]}', "x.jsonl:2: message 0 must be an object with 'role' and 'content'"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}',
     "x.jsonl:2: message 1 (assistant) is empty"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, words):
    path = tmp_path / "x.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(SFTLineError, match=re.escape(words)) as err:
        SFTLowLevelDataset(str(path))
    assert "\n" not in str(err.value)


def test_split_matrix_is_megatron_core():
    assert split_matrix("969, 30, 1") == [(0.0, 0.969), (0.969, 0.999), (0.999, 1.0)]
    assert split_matrix("1,0,0") == [(0.0, 1.0), None, None]


def test_a_split_asked_for_no_samples_is_none(tok):
    """--eval-iters 0 asks the validation split for 0 samples: no dataset (an empty one made the loader fail)."""
    train, valid, test = SFTBuilder(ChatFormat(tok, "hf"), 48).build([4, 0, 0], [str(SAMPLE)], "90,10,0")
    assert len(train) == 4 and valid is None and test is None
