"""Zero-shot evaluation (tasks/main.py WIKITEXT103 / LAMBADA) against Hugging Face GPT2LMHeadModel on the same weights.

The reference below is written independently of tasks/zeroshot_gpt: HF `tokenizers` byte-level BPE, a plain
"score each target once, with as much left context as the window allows" loop, and HF's logits.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.models.gpt.hf_gpt2 import hf_gpt2_config_kwargs, megatron_gpt_to_hf_state_dict
from tasks.zeroshot_gpt.datasets import LMWindowDataset
from tasks.zeroshot_gpt.detokenizer import wikitext_detokenizer
from tests.dist_utils import run_distributed
from tests.fixtures import FIXTURES
from tests.tasks import helpers as H

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WIKI_LINES, LAMBADA_LINES, STRIDE, MBS = 40, 50, 32, 8


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def setup(shared_data, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("zeroshot")
    flat = H.random_state_dict(seed=0)
    # A model whose greedy prediction is always ' the' (final LayerNorm weight 0, bias = embedding of ' the'):
    # makes LAMBADA accuracy non-trivial and checks that every target token of the last word must be right.
    const = {k: v.clone() for k, v in flat.items()}
    the_id = json.loads((shared_data / "openwebtext-1000" / "gpt2-tiny-vocab.json").read_text())["\u0120the"]
    emb = const["language_model.embedding.word_embeddings.weight"]
    const["language_model.encoder.final_layernorm.weight"].zero_()
    const["language_model.encoder.final_layernorm.bias"].copy_(emb[the_id])
    out = {"dir": d, "flat": flat, "const": const,
           "ckpt1": H.save_megatron_checkpoint(flat, d / "ckpt_tp1"),
           "ckpt2": H.save_megatron_checkpoint(flat, d / "ckpt_tp2", tp=2),
           "ckpt_const": H.save_megatron_checkpoint(const, d / "ckpt_const"),
           "wiki": H.write_wikitext_slice(shared_data, d / "wiki.test.tokens", WIKI_LINES),
           "lambada": H.write_lambada_slice(shared_data, d / "lambada_test.jsonl", LAMBADA_LINES),
           "synthetic": H.write_jsonl([
               "She walked to the door and opened the",          # ' the' -> correct (both modes)
               "He looked at the dog",                            # wrong
               "Everybody went to see the play at the theatrical",  # strict: ' the'+'atrical' -> wrong
               "They sat down near the",                          # correct
               "It was all about the",                            # correct
           ], d / "lambada_synthetic.jsonl")}
    return out


@pytest.fixture(scope="module")
def hf_tok(shared_data):
    owt = shared_data / "openwebtext-1000"
    return tokenizers.ByteLevelBPETokenizer(str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt"))


def _hf_model(flat: dict):
    config = H.tiny_config()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_gpt2_config_kwargs(config))).eval()
    hf.load_state_dict(megatron_gpt_to_hf_state_dict(flat, config), strict=False)
    return hf


# ----------------------------------------------------------------------------------------------- references
def hf_wikitext(flat: dict, hf_tok, path: Path, seq: int, stride: int) -> dict:
    raw = path.read_text(encoding="utf-8")
    ids = hf_tok.encode(wikitext_detokenizer(raw)).ids
    hf = _hf_model(flat)
    total = H.strided_window_loss(hf, ids, seq, stride)
    n_tok, n_orig = len(ids), len(raw.strip().split(" "))
    loss = total / (n_tok - 1)
    ratio = (n_tok - 1) / (n_orig - 1)
    return {"avg_loss": loss, "ppl": math.exp(loss), "adjusted_ppl": math.exp(loss * ratio), "token_ratio": ratio}


def hf_lambada(flat: dict, hf_tok, path: Path, seq: int, strict: bool) -> float:
    hf = _hf_model(flat)
    correct = 0
    texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for text in texts:
        if strict:
            last = text.split()[-1]
            ctx = hf_tok.encode(text[:text.rfind(last)].strip()).ids
            label = hf_tok.encode(" " + last).ids
        else:
            full = hf_tok.encode(text).ids
            ctx, label = full[:-1], full[-1:]
        ids = (ctx + label)[-(seq + 1):]
        with torch.no_grad():
            pred = hf(input_ids=torch.tensor([ids[:-1]])).logits[0].argmax(-1)
        correct += int(pred[-len(label):].tolist() == label)
    return correct / len(texts)


# ----------------------------------------------------------------------------------------------- runners
def _argv(setup: dict, shared_data: Path, task: str, data: Path, ckpt: str = "ckpt1", tp: int = 1,
          extra: tuple = ()) -> list[str]:
    return (["--task", task, "--valid-data", str(data), "--micro-batch-size", str(MBS)]
            + H.model_flags(shared_data, setup[ckpt], tp) + list(extra))


def _run_in_process(argv: list[str]) -> dict:
    from megatron.initialize import destroy_megatron
    from tasks.main import main

    try:
        return main(argv)
    finally:
        destroy_megatron()


def _dist_body(rank: int, world_size: int, runs: list) -> list:
    return [_run_in_process(argv) for argv in runs]


# ----------------------------------------------------------------------------------------------- tests
def test_window_dataset_scores_every_target_once():
    tokens = list(range(100))
    for seq, stride in [(16, 16), (16, 4), (16, 5), (32, 1), (200, 8)]:
        ds = LMWindowDataset(tokens, seq, pad_idx=-1, num_original_tokens=1, num_tokenized_tokens=100,
                             overlapping_eval=stride)
        scored = []
        for i in range(len(ds)):
            item = ds[i]
            assert item["text"].shape == (seq + 1,) and item["pad_mask"].shape == (seq,)
            scored += item["text"][1:][item["pad_mask"].astype(bool)].tolist()
        assert sorted(scored) == list(range(1, 100)), (seq, stride)


@pytest.mark.slow  # evaluation processes
def test_wikitext_and_lambada_equal_hf(setup, shared_data, hf_tok):
    wiki = _run_in_process(_argv(setup, shared_data, "WIKITEXT103", setup["wiki"],
                                 extra=("--overlapping-eval", str(STRIDE))))
    setup["tp1_wiki"] = wiki
    ref = hf_wikitext(setup["flat"], hf_tok, setup["wiki"], H.SEQ, STRIDE)
    for key, value in ref.items():
        assert wiki[key] == pytest.approx(value, rel=1e-4, abs=1e-4), key
    assert 1.2 < wiki["token_ratio"] < 2.0 and wiki["avg_loss"] > 5

    for strict in (False, True):
        extra = ("--strict-lambada",) if strict else ()
        for ckpt, flat, data in (("ckpt1", setup["flat"], setup["lambada"]),
                                 ("ckpt_const", setup["const"], setup["synthetic"])):
            res = _run_in_process(_argv(setup, shared_data, "LAMBADA", data, ckpt=ckpt, extra=extra))
            if strict and ckpt == "ckpt1":
                setup["tp1_lambada"] = res
            assert res["accuracy"] == pytest.approx(hf_lambada(flat, hf_tok, data, H.SEQ, strict), abs=1e-9)
        # the constant ' the' predictor: 3 of 5 in both modes ('theatrical' fails: strict needs ' the'+'atrical')
        assert res["number_correct"] == 3 and res["total_examples"] == 5


def test_tp2_dp2_equals_tp1(setup, shared_data):
    wiki_extra = ("--overlapping-eval", str(STRIDE))
    runs = {
        "wiki": lambda ckpt, tp: _argv(setup, shared_data, "WIKITEXT103", setup["wiki"], ckpt, tp, wiki_extra),
        "lambada": lambda ckpt, tp: _argv(setup, shared_data, "LAMBADA", setup["lambada"], ckpt, tp,
                                          ("--strict-lambada",)),
    }
    tp1 = {name: setup.get(f"tp1_{name}") or _run_in_process(make("ckpt1", 1)) for name, make in runs.items()}
    # world 4 = TP 2 x DP 2: vocab-parallel loss / gathered argmax, windows split over data-parallel ranks
    results = run_distributed(_dist_body, world_size=4, args=([make("ckpt2", 2) for make in runs.values()],))
    for rank_results in results:
        for name, res in zip(runs, rank_results):
            for key, value in tp1[name].items():
                assert res[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)


def test_cli_end_to_end(setup, shared_data, repo_root):
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    argv = _argv(setup, shared_data, "WIKITEXT103", setup["wiki"], extra=("--overlapping-eval", str(STRIDE)))
    proc = subprocess.run([sys.executable, str(repo_root / "tasks" / "main.py"), *argv], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(" validation results on WIKITEXT103 | "))
    assert set(lines[i - 1]) == {"-"} and set(lines[i + 1]) == {"-"} and len(lines[i - 1]) == len(lines[i]) + 1
    m = re.fullmatch(r" validation results on WIKITEXT103 \| avg loss: (\S+) \| ppl: (\S+) \| adjusted ppl: (\S+) \| "
                     r"token ratio: (\S+) \|", lines[i])
    assert m, lines[i]
    loss, ppl, adj, ratio = map(float, m.groups())
    assert ppl == pytest.approx(math.exp(loss), rel=1e-3) and adj == pytest.approx(math.exp(loss * ratio), rel=1e-3)
    # progress on rank 0: stderr is a pipe here, so plain lines (no tqdm `\r` redraws), the last one at 100%
    assert "\r" not in proc.stderr and re.search(r"^evaluating: (\d+)/\1 batches \(100%\)", proc.stderr, re.M)

    argv = _argv(setup, shared_data, "LAMBADA", setup["synthetic"], ckpt="ckpt_const")
    proc = subprocess.run([sys.executable, str(repo_root / "tasks" / "main.py"), *argv], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (" validation results on LAMBADA | number correct: 3.0000E+00 | total examples: 5.0000E+00 | "
            "avg accuracy: 6.0000E-01") in proc.stdout.splitlines()


def test_bad_input_is_one_line(setup, shared_data, repo_root, tmp_path):
    from megatron.errors import MegatronUserError

    bad = tmp_path / "bad_lambada.jsonl"
    bad.write_text('{"text": "fine line"}\nnot json\n')
    for task, data, needle in (("WIKITEXT103", tmp_path / "missing.tokens", "--valid-data"),
                               ("SQUAD", setup["wiki"], "--task SQUAD")):  # RACE/MNLI/QQP finetune now
        with pytest.raises(MegatronUserError, match=re.escape(needle)):
            _run_in_process(_argv(setup, shared_data, task, data))
    proc = subprocess.run([sys.executable, str(repo_root / "tasks" / "main.py"),
                           *_argv(setup, shared_data, "LAMBADA", bad)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "bad_lambada.jsonl:2: not a LAMBADA jsonl line" in err[0], proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr


def test_dataset_items_are_int64_numpy(setup, shared_data):
    from tasks.zeroshot_gpt.datasets import build_lambada_dataset

    class _Tok:
        eod = 0

        def tokenize(self, text):
            return [len(w) for w in text.split()]

    ds = build_lambada_dataset(str(setup["synthetic"]), _Tok(), 8, strict=True)
    item = ds[0]
    assert item["text"].dtype == np.int64 and item["pad_mask"].tolist() == [0, 0, 0, 0, 0, 0, 1, 0]


def test_full_files_with_gpt2_vocab(wide_data):
    """The whole WikiText-103 test set and LAMBADA (or the fixture slices) with the GPT-2 vocabulary: sizes."""
    import argparse

    from megatron.tokenizer import build_tokenizer
    from tasks.zeroshot_gpt.datasets import build_lambada_dataset, build_wikitext_dataset

    bpe = wide_data / "gpt2-bpe"
    tok = build_tokenizer(argparse.Namespace(
        tokenizer_type="GPT2BPETokenizer", vocab_file=str(bpe / "gpt2-vocab.json"),
        merge_file=str(bpe / "gpt2-merges.txt"), tokenizer_model=None, tokenizer_name_or_path=None, vocab_size=None,
        vocab_extra_ids=0, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, rank=0))
    full = wide_data != FIXTURES
    wiki = build_wikitext_dataset(str(wide_data / "wikitext-103" / "wiki.test.tokens"), tok, 1024, 32)
    expected = (270330, 245566, 8448) if full else (35476, 32851, 1109)  # full file / first 530 lines
    assert (wiki.num_tokenized_tokens, wiki.num_original_tokens, len(wiki)) == expected
    lambada = build_lambada_dataset(str(wide_data / "lambada" / "lambada_test.jsonl"), tok, 1024, True)
    assert len(lambada) == (5153 if full else 500)
