"""`convert.py --saver hf` writes the tokenizer files of every --tokenizer-type we train with (GPT2BPETokenizer,
BertWordPiece*, SentencePieceTokenizer (T5's unigram model), Llama2Tokenizer, HuggingFaceTokenizer, PretrainedFromHF as BLOOM runs use):
AutoTokenizer loads the export and gives the training tokenizer's ids on sample texts; a tokenizer whose files are
gone is refused in one line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import pytest

from megatron.checkpoint.conversion.driver import convert, parse_args
from megatron.checkpoint.conversion.interchange import ConversionError, messages_from_state_dict
from megatron.checkpoint.conversion.megatron_format import write_megatron
from megatron.layers.attention import reset_flash_attn_cache
from megatron.run_configs.tokenizer import TokenizerSettings
from megatron.tokenizer.tokenizer import make_tokenizer
from tests.tools.checkpoint_convert_helpers import build, config, meta_for

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
TINY_GPT2 = FIXTURES / "openwebtext-1000"
SAMPLES = ["Hello world, this is a test.", " leading space and  two spaces", "def f(x):\n    return x ** 2\n",
           "Numbers 12345 and UPPER case; ünïcödé.", "special <EOD> token"]


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
    "SentencePieceTokenizer": ("llama", lambda d: dict(tokenizer_model=str(FIXTURES / "t5-sentencepiece" /
                                                                           "spiece.model"))),
    "Llama2Tokenizer": ("llama", lambda d: dict(tokenizer_model=d["sp"])),
    "HuggingFaceTokenizer": ("llama", lambda d: dict(tokenizer_model=d["hf"])),
    "PretrainedFromHF": ("bloom", lambda d: dict(tokenizer_name_or_path=d["hf"])),
}


def _source(tmp_path: Path, family: str, tokenizer_args: dict, vocab: int) -> Path:
    cfg = config(family, padded=-(-vocab // 64) * 64, max_position_embeddings=64)
    meta = dataclasses.replace(meta_for(cfg, true_vocab=vocab), checkpoint_args=argparse.Namespace(**tokenizer_args))
    write_megatron(meta, messages_from_state_dict(build(cfg).state_dict(), cfg.num_layers), str(tmp_path / "src"),
                   1, 1, None)
    return tmp_path / "src"


def _convert(src: Path, out: Path, saver: str = "hf") -> Path:
    convert(parse_args(["--model-type", "GPT", "--loader", "megatron", "--saver", saver,
                        "--load-dir", str(src), "--save-dir", str(out)]))
    return out


def _export(tmp_path: Path, family: str, tokenizer_args: dict, vocab: int) -> Path:
    return _convert(_source(tmp_path, family, tokenizer_args, vocab), tmp_path / "hf")


@pytest.mark.parametrize("tok_type", list(CASES))
def test_every_tokenizer_type_exports_a_folder_autotokenizer_loads(tok_type: str, tokenizer_dirs: dict,
                                                                   tmp_path: Path) -> None:
    family, files = CASES[tok_type]
    tokenizer_args = dict(tokenizer_type=tok_type, **files(tokenizer_dirs))
    ours = make_tokenizer(TokenizerSettings.from_args(argparse.Namespace(**tokenizer_args)))
    out = _export(tmp_path, family, tokenizer_args, ours.vocab_size)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    # BERT's WordPiece ids without the [CLS] ... [SEP] HF adds (Megatron's BERT dataset adds them itself)
    special = not tok_type.startswith("BertWordPiece")
    for text in SAMPLES:
        assert hf_tok(text, add_special_tokens=special)["input_ids"] == ours.tokenize(text), (tok_type, text)
    assert len(hf_tok) == ours.vocab_size
    generation = json.loads((out / "generation_config.json").read_text())
    if tok_type in ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "PretrainedFromHF"):
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


ALARMS = ("must be `None` or an integer within the vocabulary", "Token indices sequence length is longer",
          "> attention:", "torch.distributed is disabled", "Setting accelerator to CPU")


@pytest.mark.parametrize("family,tok_type", [("gpt2", "GPT2BPETokenizer"), ("llama", "Llama2Tokenizer")])
def test_conversion_and_loading_the_export_raise_no_false_alarms(family: str, tok_type: str, tokenizer_dirs: dict,
                                                                 tmp_path: Path, capfd) -> None:
    """A correct export converts, and loads in transformers (config, tokenizer on a text longer than the model,
    model, generate), without the warnings that are no problem: BOS/EOS outside a small vocabulary (GPT2Config's
    default 50256), the tokenizer's length limit, the attention-path line of the layout-only model, torch's
    single-process DCP warning (the torch_dist saver) and DeepSpeed's accelerator guess."""
    import warnings

    import megatron.ds.engine  # noqa: F401  (sets DeepSpeed's accelerator on a CPU machine)

    files = CASES[tok_type][1](tokenizer_dirs)
    ours = make_tokenizer(TokenizerSettings.from_args(argparse.Namespace(tokenizer_type=tok_type, **files)))
    src = _source(tmp_path, family, dict(tokenizer_type=tok_type, **files), ours.vocab_size)
    reset_flash_attn_cache()  # a fresh convert.py process has printed no attention line yet
    capfd.readouterr()
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append  # transformers' own handler writes to the stream of its first use
    logging.getLogger("transformers").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _convert(src, tmp_path / "hf")
        _convert(src, tmp_path / "dist", saver="mcore")
        hf_tok = transformers.AutoTokenizer.from_pretrained(out)
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        ids = hf_tok(" ".join(SAMPLES * 20), return_tensors="pt")["input_ids"]
        assert ids.size(1) > 64  # longer than the model: the caller windows it, as lm-eval does
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)
        import deepspeed.accelerator

        deepspeed.accelerator.get_accelerator()
    logging.getLogger("transformers").removeHandler(handler)
    captured = capfd.readouterr()
    text = "\n".join([captured.out, captured.err] + [str(w.message) for w in caught] +
                     [r.getMessage() for r in records])
    assert not [alarm for alarm in ALARMS if alarm in text], text
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["eos_token_id"] == ours.eod if tok_type == "GPT2BPETokenizer" else ours.eos


def test_the_weightless_layout_model_of_conversion_prints_no_attention_line(capsys) -> None:
    """Conversion builds a model on the meta device to read the TP layouts: it runs no attention, so it does not
    print which attention path would run (a real model still does)."""
    import torch

    from megatron.models.gpt.model import GPTModel

    reset_flash_attn_cache()
    with torch.device("meta"):
        GPTModel(config("gpt2"))
    assert "> attention:" not in capsys.readouterr().out
    build(config("gpt2"))
    assert capsys.readouterr().out.count("> attention:") == 1
