"""`bash examples/quickstart.sh llama` from the repository alone: a SentencePiece tokenizer.model trained on the
shipped corpus, Llama2Tokenizer preprocessing, a tiny Llama trained (stop and resume), greedy samples, WikiText and
LAMBADA evaluation, Hugging Face export (AutoTokenizer gives our ids) and back (same greedy tokens). The short run
(TRAIN_ITERS 10 through the llama_tiny preset, whose own warmup is 20 iterations) also proves that the example
script derives its warmup from the run length."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_llama_leg(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path / "qs"), LLAMA_TRAIN_ITERS="10", LOG_INTERVAL="5", WIKI_LINES="10",
               LAMBADA_LINES="10", SKIP_INSTALL="1", OMP_NUM_THREADS="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    proc = subprocess.run(["bash", str(REPO / "examples" / "quickstart.sh"), "llama"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"Llama training OK: loss [0-9.]+ -> [0-9.]+", proc.stdout)
    assert "Hugging Face round trip OK" in proc.stdout
    assert re.search(r"^ validation loss at iteration 5 \| lm loss value: ", proc.stdout, flags=re.M)
    assert re.search(r"validation results on WIKITEXT103 \| avg loss: [0-9.]+E[+-]\d+ \| ppl", proc.stdout)
    assert re.search(r"validation results on LAMBADA \| number correct: [0-9.E+-]+ \| total examples: 1\.0+E\+01",
                     proc.stdout)
    assert re.search(r"^ > first iteration done in [0-9.]+ s \(iteration 1 of 10;", proc.stdout, flags=re.M)
    out = tmp_path / "qs"
    hf = out / "llama_hf"
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(
        os.listdir(hf))
    assert json.loads((hf / "generation_config.json").read_text())["bos_token_id"] == 1
    assert len((out / "llama_samples.jsonl").read_text().splitlines()) == 2
