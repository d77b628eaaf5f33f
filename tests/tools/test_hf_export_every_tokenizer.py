"""`convert.py --saver hf` writes the tokenizer files of every --tokenizer-type we train with (GPT2BPETokenizer,
BertWordPiece*, Llama2Tokenizer, HuggingFaceTokenizer, PretrainedFromHF as BLOOM runs use):
AutoTokenizer loads the export and gives the training tokenizer's ids on sample texts; a tokenizer whose files are
gone is refused in one line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from megatron.checkpoint.conversion.driver import convert, parse_args
from megatron.checkpoint.conversion.interchange import ConversionError, messages_from_state_dict
from megatron.checkpoint.conversion.megatron_format import write_megatron
from megatron.run_configs.tokenizer import TokenizerSettings
from megatron.tokenizer.tokenizer import make_tokenizer
from tests.tools.checkpoint_convert_helpers import build, config, meta_for

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
TINY_GPT2 = FIXTURES / "openwebtext-1000"
SAMPLES = ["Hello world, this is a test.", " leading space and  two spaces", "def f(x):\n    return x ** 2\n",
           "Numbers 12345 and UPPER case; ünïcödé."]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict:
    """A trained Llama-style sentencepiece model and a HF tokenizer folder (the tiny GPT-2 BPE saved with
    save_pretrained), as PretrainedFromHF / HuggingFaceTokenizer runs name them."""
    from transformers import PreTrainedTokenizerFast

    from megatron.tokenizer.gpt2_bpe import _HFEngine, load_merges, load_vocab

    sys.path.insert(0, str(REPO / "tools"))
    from train_sentencepiece_tokenizer import train

    root = tmp_path_factory.mktemp("tok")
    sp = train([str(REPO / "examples" / "data" / "python_docs.jsonl")], 600, str(root / "sp"))
    engine = _HFEngine(load_vocab(str(TINY_GPT2 / "gpt2-tiny-vocab.json")),
                       load_merges(str(TINY_GPT2 / "gpt2-tiny-merges.txt")))
    PreTrainedTokenizerFast(tokenizer_object=engine._tok, eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(root / "hf")
    return {"sp": str(sp), "hf": str(root / "hf")}


CASES = {
    "GPT2BPETokenizer": ("gpt2", lambda d: dict(vocab_file=str(TINY_GPT2 / "gpt2-tiny-vocab.json"),
                                                merge_file=str(TINY_GPT2 / "gpt2-tiny-merges.txt"))),
    "BertWordPieceLowerCase": ("gpt2", lambda d: dict(vocab_file=str(FIXTURES / "bert-wordpiece" /
                                                                     "bert-base-uncased-vocab.txt"))),
    "BertWordPieceCase": ("gpt2", lambda d: dict(vocab_file=str(FIXTURES / "bert-wordpiece" /
                                                                "bert-base-cased-vocab.txt"))),
    "Llama2Tokenizer": ("llama", lambda d: dict(tokenizer_model=d["sp"])),
    "HuggingFaceTokenizer": ("llama", lambda d: dict(tokenizer_model=d["hf"])),
    "PretrainedFromHF": ("bloom", lambda d: dict(tokenizer_name_or_path=d["hf"])),
}


def _export(tmp_path: Path, family: str, tokenizer_args: dict, vocab: int) -> Path:
    cfg = config(family, padded=-(-vocab // 64) * 64, max_position_embeddings=64)
    meta = dataclasses.replace(meta_for(cfg, true_vocab=vocab), checkpoint_args=argparse.Namespace(**tokenizer_args))
    write_megatron(meta, messages_from_state_dict(build(cfg).state_dict(), cfg.num_layers), str(tmp_path / "src"),
                   1, 1, None)
    convert(parse_args(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
                        "--load-dir", str(tmp_path / "src"), "--save-dir", str(tmp_path / "hf")]))
    return tmp_path / "hf"


@pytest.mark.parametrize("tok_type", list(CASES))
def test_every_tokenizer_type_exports_a_folder_autotokenizer_loads(tok_type: str, tokenizer_dirs: dict,
                                                                   tmp_path: Path) -> None:
    family, files = CASES[tok_type]
    tokenizer_args = dict(tokenizer_type=tok_type, **files(tokenizer_dirs))
    ours = make_tokenizer(TokenizerSettings(**tokenizer_args))
    out = _export(tmp_path, family, tokenizer_args, ours.vocab_size)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    # BERT's WordPiece ids without the [CLS] ... [SEP] HF adds (Megatron's BERT dataset adds them itself)
    special = not tok_type.startswith("BertWordPiece")
    for text in SAMPLES:
        assert hf_tok(text, add_special_tokens=special)["input_ids"] == ours.tokenize(text), (tok_type, text)
    assert len(hf_tok) == ours.vocab_size
    generation = json.loads((out / "generation_config.json").read_text())
    if tok_type in ("GPT2BPETokenizer", "HuggingFaceTokenizer", "PretrainedFromHF"):
        assert generation["eos_token_id"] == ours.eod


def test_missing_tokenizer_files_are_refused_in_one_line(tmp_path: Path) -> None:
    gone = str(tmp_path / "moved" / "vocab.json")
    with pytest.raises(ConversionError) as info:
        _export(tmp_path, "gpt2", dict(tokenizer_type="GPT2BPETokenizer", vocab_file=gone,
                                       merge_file=str(TINY_GPT2 / "gpt2-tiny-merges.txt")), 5000)
    msg = str(info.value)
    assert f"--vocab-file {gone}, which is not here" in msg and "\n" not in msg
    assert not os.path.exists(tmp_path / "hf")  # nothing left under the target name


def test_a_hub_tokenizer_not_in_the_cache_is_named_in_a_note(tmp_path: Path, capsys) -> None:
    """A PretrainedFromHF run that named a hub tokenizer absent from the local cache: the weights are written and
    one line says which tokenizer to add and how."""
    out = _export(tmp_path, "bloom", dict(tokenizer_type="PretrainedFromHF",
                                          tokenizer_name_or_path="no-such-org/no-such-tokenizer"), 61)
    notes = [line for line in capsys.readouterr().out.splitlines() if "no-such-org/no-such-tokenizer" in line]
    assert len(notes) == 1 and "not in the local Hugging Face cache" in notes[0], notes
    assert "save_pretrained(<--save-dir>)" in notes[0] and (out / "model.safetensors").is_file()
