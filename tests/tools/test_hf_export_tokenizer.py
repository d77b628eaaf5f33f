"""`convert.py --saver hf` of a Llama checkpoint trained with a Llama2Tokenizer writes a complete Hugging Face folder:
AutoTokenizer on it gives the training tokenizer's ids (BOS added, no EOS) on the shipped corpus, WikiText and
LAMBADA lines (except text spelling "<unk>", which HF matches as the special token), generation_config.json and config.json carry its BOS/EOS, and every file is world-readable."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from megatron.checkpoint.conversion.driver import convert, parse_args
from megatron.checkpoint.conversion.interchange import messages_from_state_dict
from megatron.checkpoint.conversion.megatron_format import write_megatron
from tests.tools.checkpoint_convert_helpers import build, config, meta_for

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    from train_sentencepiece_tokenizer import train

    return train([str(REPO / "examples" / "data" / "python_docs.jsonl")], 600,
                 str(tmp_path_factory.mktemp("sp")))


def _texts() -> list[str]:
    fixtures = REPO / "tests" / "fixtures"
    corpus = [json.loads(line)["text"] for line in open(REPO / "examples" / "data" / "python_docs.jsonl")]
    wiki = (fixtures / "wikitext-103" / "wiki.test.tokens").read_text(encoding="utf-8").splitlines(keepends=True)
    lambada = [json.loads(line)["text"] for line in open(fixtures / "lambada" / "lambada_test.jsonl")]
    return corpus[:20] + wiki[:200] + lambada[:100] + [" leading space", "  two", "tab\tand\nnew line", "😀 12345"]


def test_llama_hf_export_has_the_training_tokenizer(sp_model: Path, tmp_path: Path) -> None:
    from megatron.tokenizer.llama2_tokenizer import Llama2Tokenizer

    ours = Llama2Tokenizer(str(sp_model))
    cfg = config("llama", padded=ours.vocab_size, max_position_embeddings=64)
    meta = dataclasses.replace(meta_for(cfg, true_vocab=ours.vocab_size), checkpoint_args=argparse.Namespace(
        tokenizer_type="Llama2Tokenizer", tokenizer_model=str(sp_model)))
    write_megatron(meta, messages_from_state_dict(build(cfg).state_dict(), cfg.num_layers), str(tmp_path / "src"),
                   1, 1, None)
    old_umask = os.umask(0o022)
    try:
        convert(parse_args(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
                            "--load-dir", str(tmp_path / "src"), "--save-dir", str(tmp_path / "hf")]))
    finally:
        os.umask(old_umask)
    out = tmp_path / "hf"
    names = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.model", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= names, names
    for name in names:  # world-readable like any file pip or git writes (umask 022)
        assert stat.S_IMODE(os.stat(out / name).st_mode) & 0o044 == 0o044, (name, oct(os.stat(out / name).st_mode))
    assert stat.S_IMODE(os.stat(out).st_mode) & 0o055 == 0o055, oct(os.stat(out).st_mode)

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    texts = _texts()
    differ = [t for t in texts if hf_tok(t)["input_ids"] != ours.tokenize(t)]
    # Hugging Face matches the special tokens' spellings inside text ("<unk>" is in WikiText); sentencepiece and
    # Megatron's Llama2Tokenizer read them as ordinary text. Every other text gives identical ids.
    literal = [t for t in texts if any(s in t for s in ("<unk>", "<s>", "</s>"))]
    assert sorted(differ) == sorted(literal) and len(texts) - len(literal) > 250, differ[:1]
    assert hf_tok("Hello")["input_ids"][0] == ours.bos and ours.eos not in hf_tok("Hello")["input_ids"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (ours.bos, ours.eos) == (1, 2)
    hf_config = json.loads((out / "config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (1, 2)
    # no tokenizer limit (transformers would warn on every longer text); the model's length is config.json's
    assert "model_max_length" not in json.loads((out / "tokenizer_config.json").read_text())
    assert hf_config["max_position_embeddings"] == 64
