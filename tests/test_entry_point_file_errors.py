"""Every entry point answers a wrong input file with one line (issue 29 item 2): each process below gets one missing or
garbage file flag (tokenizer files, --data-path, task data, checkpoint folders, preprocessing input) and must exit 1
with exactly one stderr line, `error: ...` naming the flag's file, no traceback, and stop before building a model."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.presets import get_preset

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures"
VOCAB, MERGES = str(FIX / "gpt2-bpe" / "gpt2-vocab.json"), str(FIX / "gpt2-bpe" / "gpt2-merges.txt")
BERT_VOCAB = str(FIX / "bert-wordpiece" / "bert-base-uncased-vocab.txt")
SPM = str(FIX / "t5-sentencepiece" / "spiece.model")
MODEL = [*get_preset("gpt_micro_test").argv(), "--micro-batch-size", "2"]
TRAIN = [*MODEL, "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--eval-iters", "0"]
MISSING = "/nonexistent/missing-file"

# (name, script, argv with {missing}/{garbage}/{data}, the flag the error line must name)
CASES = [
    ("gpt-vocab-missing", "pretrain_gpt.py", [*TRAIN, "--vocab-file", MISSING, "--merge-file", MERGES,
                                              "--data-path", "{data}"], "--vocab-file"),
    ("gpt-vocab-garbage", "pretrain_gpt.py", [*TRAIN, "--vocab-file", "{garbage}", "--merge-file", MERGES,
                                              "--data-path", "{data}"], "--vocab-file"),
    ("gpt-merges-is-vocab", "pretrain_gpt.py", [*TRAIN, "--vocab-file", VOCAB, "--merge-file", VOCAB,
                                                "--data-path", "{data}"], "--merge-file"),
    ("gpt-data-missing", "pretrain_gpt.py", [*TRAIN, "--vocab-file", VOCAB, "--merge-file", MERGES,
                                             "--data-path", MISSING], "--data-path"),
    ("gpt-data-garbage", "pretrain_gpt.py", [*TRAIN, "--vocab-file", VOCAB, "--merge-file", MERGES,
                                             "--data-path", "{bad_data}"], "--data-path"),
    ("llama-model-garbage", "pretrain_gpt.py", [*TRAIN, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                                                "{garbage}", "--data-path", "{data}"], "--tokenizer-model"),
    ("bert-vocab-missing", "pretrain_bert.py", [*TRAIN, "--vocab-file", MISSING, "--data-path", "{data}"],
     "--vocab-file"),
    ("bert-data-missing", "pretrain_bert.py", [*TRAIN, "--vocab-file", BERT_VOCAB, "--data-path", MISSING],
     "--data-path"),
    ("t5-spm-garbage", "pretrain_t5.py", [*TRAIN, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                          "{garbage}", "--vocab-extra-ids", "100", "--encoder-seq-length", "32",
                                          "--decoder-seq-length", "16", "--data-path", "{data}"], "--tokenizer-model"),
    ("generate-vocab-missing", "tools/generate_samples_gpt.py", [*MODEL, "--vocab-file", MISSING, "--merge-file",
                                                                 MERGES, "--load", "{ckpt}"], "--vocab-file"),
    ("server-merges-missing", "tools/run_text_generation_server.py", [*MODEL, "--vocab-file", VOCAB, "--merge-file",
                                                                      MISSING, "--load", "{ckpt}"], "--merge-file"),
    ("task-vocab-missing", "tasks/main.py", [*MODEL, "--task", "MNLI", "--vocab-file", MISSING, "--tokenizer-type",
                                             "BertWordPieceLowerCase", "--train-data",
                                             str(FIX / "mnli-sample" / "train.tsv"), "--valid-data",
                                             str(FIX / "mnli-sample" / "dev_matched.tsv"), "--epochs", "1",
                                             "--lr", "1e-4"], "--vocab-file"),
    ("task-train-data-missing", "tasks/main.py", [*MODEL, "--task", "MNLI", "--vocab-file", BERT_VOCAB,
                                                  "--tokenizer-type", "BertWordPieceLowerCase", "--train-data",
                                                  MISSING, "--valid-data", str(FIX / "mnli-sample" / "dev_matched.tsv"),
                                                  "--epochs", "1", "--lr", "1e-4"], "--train-data"),
    ("convert-load-dir-missing", "tools/checkpoint/convert.py", ["--model-type", "GPT", "--loader", "megatron",
                                                                 "--saver", "megatron", "--load-dir", MISSING,
                                                                 "--save-dir", "{out}"], "--load-dir"),
    ("preprocess-input-missing", "tools/preprocess_data.py", ["--input", MISSING, "--output-prefix", "{out}",
                                                              "--vocab-file", VOCAB, "--merge-file", MERGES,
                                                              "--tokenizer-type", "GPT2BPETokenizer"], "--input"),
    ("preprocess-vocab-garbage", "tools/preprocess_data.py", ["--input", str(FIX / "lambada" / "lambada_test.jsonl"),
                                                              "--output-prefix", "{out}", "--vocab-file", "{garbage}",
                                                              "--merge-file", MERGES, "--tokenizer-type",
                                                              "GPT2BPETokenizer"], "--vocab-file"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("bad_inputs")
    garbage = root / "garbage.bin"
    garbage.write_bytes(bytes(range(256)) * 8)  # neither JSON, UTF-8 text nor a SentencePiece model
    for ext in (".bin", ".idx"):
        (root / f"bad_text_document{ext}").write_bytes(bytes(range(256)))
    (root / "ckpt").mkdir()
    return {"garbage": str(garbage), "bad_data": str(root / "bad_text_document"), "data": MISSING,
            "ckpt": str(root / "ckpt"), "out": str(root / "out")}


@pytest.mark.slow
@pytest.mark.parametrize("name,script,argv,flag", CASES, ids=[c[0] for c in CASES])
def test_wrong_input_file_is_one_line(name: str, script: str, argv: list[str], flag: str, files: dict,
                                      tmp_path: Path) -> None:
    argv = [a.format(**files) for a in argv]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / script), *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert flag in lines[0], lines[0]
    assert not re.search(r"building \S+ model|loading checkpoint", proc.stdout), proc.stdout[-2000:]
