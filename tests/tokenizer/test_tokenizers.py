"""build_tokenizer for every --tokenizer-type: special ids, padding, engines, errors, no torch at import."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron.tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer, bytes_to_unicode

REPO = Path(__file__).resolve().parents[2]


def _args(**kw) -> types.SimpleNamespace:
    base = dict(rank=0, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, vocab_extra_ids=0)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture(scope="module")
def gpt2_files(shared_data: Path) -> tuple:
    return str(shared_data / "gpt2-bpe" / "gpt2-vocab.json"), str(shared_data / "gpt2-bpe" / "gpt2-merges.txt")


def test_vocab_padding_and_log_lines(gpt2_files, capsys):
    assert vocab_size_with_padding(50257, 128, 1) == 50304
    assert vocab_size_with_padding(50257, 128, 2) == 50432
    assert vocab_size_with_padding(50304, 128, 1) == 50304
    assert vocab_size_with_padding(30524, 128, 8) == 30720
    args = _args(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1],
                 tensor_model_parallel_size=2)
    tok = build_tokenizer(args)
    assert args.padded_vocab_size == 50432 and tok.vocab_size == 50257
    assert capsys.readouterr().out == ("> building GPT2BPETokenizer tokenizer ...\n"
                                       " > padded vocab (size: 50257) with 175 dummy tokens (new size: 50432)\n")
    build_tokenizer(_args(tokenizer_type="NullTokenizer", vocab_size=10, rank=1))
    assert capsys.readouterr().out == ""  # only rank 0 prints


def test_gpt2_special_and_literal_endoftext(gpt2_files):
    tok = build_tokenizer(_args(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2_files[0],
                                merge_file=gpt2_files[1]))
    assert tok.eod == 50256 and tok.inv_vocab[50256] == "<|endoftext|>" and len(tok.vocab) == 50257
    # Megatron's GPT-2 BPE treats the literal string as text (HF's GPT2TokenizerFast would give 50256)
    assert tok.tokenize("a<|endoftext|>b") == [64, 27, 91, 437, 1659, 5239, 91, 29, 65]
    assert tok.detokenize(tok.tokenize("Hi") + [tok.eod]) == "Hi<|endoftext|>"
    assert tok.detokenize([tok.vocab["\u0120caf"], 2634]) == " café"  # bytes are joined before UTF-8 decoding
    lone = tok.vocab[bytes_to_unicode()[0xA9]]  # a lone UTF-8 continuation byte
    assert tok.detokenize([lone]) == "\ufffd"  # -> replacement char (errors='replace'), as Megatron
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.detokenize([50257])
    for name in ("cls", "sep", "mask", "pad"):
        with pytest.raises(AttributeError):
            getattr(tok, name)


def test_gpt2_engines_agree(gpt2_files, shared_data):
    lines = (shared_data / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8").splitlines()[:300]
    lines += ["  leading", "trailing   ", "tabs\t\tand\r\nnewlines\n\n", "ümlaut 日本語 🙂 'll 've", ""]
    engines = {name: GPT2BPETokenizer(*gpt2_files, engine=name) for name in ("tiktoken", "hf", "python")}
    assert {n: t.engine.name for n, t in engines.items()} == {"tiktoken": "tiktoken", "hf": "hf", "python": "python"}
    ref = engines["python"].tokenize_batch(lines)
    assert engines["tiktoken"].tokenize_batch(lines) == ref
    assert engines["hf"].tokenize_batch(lines) == ref


def test_gpt2_engine_choice_for_other_vocab_layouts(tmp_path):
    """A BPE trained with `tokenizers` (special token first, ids in merge order) still runs on tiktoken with the
    same ids; a vocab whose ids do not follow the merge order falls back to the `tokenizers` engine."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello world, the quick brown fox jumps over the lazy dog's back; 'tis 1234 days"] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.model.save(str(tmp_path))
    texts = ["the lazy fox says hello", "  jumps  over\n\nthe dogs 12345 ", "unseen wörds ☃"]
    ours = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert ours.engine.name == "tiktoken" and ours.eod == 0
    assert ours.tokenize_batch(texts) == [tok.encode(t).ids for t in texts]
    vocab = json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))
    a, b = sorted(vocab, key=vocab.get)[-2:]  # swap the ids of the last two merges
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "swapped.json").write_text(json.dumps(vocab), encoding="utf-8")
    swapped = GPT2BPETokenizer(str(tmp_path / "swapped.json"), str(tmp_path / "merges.txt"))
    assert swapped.engine.name == "hf"
    ref = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split()) for m in (tmp_path / "merges.txt").read_text(
        encoding="utf-8").splitlines()[1:] if m]))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert swapped.tokenize_batch(texts) == [ref.encode(t).ids for t in texts]
    assert swapped.detokenize(swapped.tokenize(texts[1])) == texts[1]


def test_gpt2_merges_not_self_consistent_use_hf_engine(tmp_path):
    """Merges b+c, a+b, ab+c: standard BPE turns "abc" into [a, bc] (bc wins first, a+bc is no merge) while
    tiktoken's whole-token shortcut would give [abc]; such files must not run on tiktoken."""
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for tok in ("bc", "ab", "abc", "<|endoftext|>"):
        vocab[tok] = len(vocab)
    (tmp_path / "v.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "m.txt").write_text("#version: 0.2\nb c\na b\nab c\n", encoding="utf-8")
    tok = GPT2BPETokenizer(str(tmp_path / "v.json"), str(tmp_path / "m.txt"))
    assert tok.engine.name == "hf"
    assert tok.tokenize("abc") == [vocab["a"], vocab["bc"]]
    assert GPT2BPETokenizer(str(tmp_path / "v.json"), str(tmp_path / "m.txt"), engine="python").tokenize("abc") == [
        vocab["a"], vocab["bc"]]
    with pytest.raises(ValueError, match="MEGATRON_BPE_ENGINE=hf"):
        GPT2BPETokenizer(str(tmp_path / "v.json"), str(tmp_path / "m.txt"), engine="tiktoken")


def test_gpt2_bad_files(tmp_path, gpt2_files):
    with pytest.raises(FileNotFoundError, match="--vocab-file .*missing.json"):
        GPT2BPETokenizer(str(tmp_path / "missing.json"), gpt2_files[1])
    with pytest.raises(ValueError, match="needs --merge-file"):
        build_tokenizer(_args(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=None))
    (tmp_path / "v.json").write_text(json.dumps({"a": 0}))
    with pytest.raises(ValueError, match="<\\|endoftext\\|>"):
        GPT2BPETokenizer(str(tmp_path / "v.json"), gpt2_files[1])
    with pytest.raises(ValueError, match="not supported"):
        build_tokenizer(_args(tokenizer_type="GPT3Tokenizer"))


def test_bert_tokenizers(shared_data):
    vocab = str(shared_data / "bert-wordpiece" / "bert-base-uncased-vocab.txt")
    args = _args(tokenizer_type="BertWordPieceLowerCase", vocab_file=vocab, vocab_extra_ids=100)
    tok = build_tokenizer(args)
    assert (tok.cls, tok.sep, tok.pad, tok.mask) == (101, 102, 0, 103)
    assert (tok.bos, tok.eos) == (30522, 30523)  # [BOS]/[EOS] appended as Megatron does
    assert tok.additional_special_tokens_ids == list(range(30524, 30624))
    assert tok.vocab_size == 30624 and args.padded_vocab_size == 30720
    assert tok.inv_vocab[30600] == "<extra_id_76>"
    ids = tok.tokenize("Hello, unaffable WORLD!")
    assert ids == [7592, 1010, 14477, 20961, 3468, 2088, 999]
    assert tok.detokenize(ids) == "hello , unaffable world !"
    cased = build_tokenizer(_args(tokenizer_type="BertWordPieceCase",
                                  vocab_file=str(shared_data / "bert-wordpiece" / "bert-base-cased-vocab.txt")))
    assert cased.vocab_size == 28998 and cased.tokenize("Hello")[0] == cased.vocab["Hello"]
    with pytest.raises(AttributeError):
        _ = tok.eod


def test_sentencepiece_specials(shared_data):
    model = str(shared_data / "t5-sentencepiece" / "spiece.model")
    args = _args(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model, vocab_extra_ids=100)
    tok = build_tokenizer(args)
    assert (tok.cls, tok.sep, tok.eod, tok.mask) == (32000, 32001, 32002, 32003)
    assert (tok.pad, tok.bos, tok.eos) == (0, 32004, 1)  # T5 has <pad>=0 and </s>=1 but no bos piece
    assert tok.vocab_size == 32105 and args.padded_vocab_size == 32128
    assert tok.additional_special_tokens_ids[0] == tok.vocab["<extra_id_0>"] == 32005
    ids = tok.tokenize("Hello<MASK>world<extra_id_3></s>")
    assert ids[1] == 32003 and ids[-2:] == [32008, 1]
    assert tok.tokenize_batch(["Hello<MASK>world<extra_id_3></s>", "plain"]) == [ids, tok.tokenize("plain")]
    assert tok.detokenize(ids) == "Hello <MASK> world <extra_id_3>  </s> "  # Megatron: a space on each side
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer(_args(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nonexistent.model"))


def test_null_tokenizer():
    args = _args(tokenizer_type="NullTokenizer", vocab_size=1000)
    tok = build_tokenizer(args)
    assert tok.vocab_size == 1001 and tok.eod == 1000 == tok.vocab_size - 1
    assert args.padded_vocab_size == 1024
    assert tok.tokenize("5 17  999") == [5, 17, 999] and tok.detokenize([5, 17, 999]) == "5 17 999"
    assert (tok.cls, tok.sep, tok.mask) == (-1, -1, -1) and tok.additional_special_tokens_ids is None
    with pytest.raises(ValueError, match="integer ids"):
        tok.tokenize("5 x 7")
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("1001")


def test_pretrained_from_hf_local_dir(tmp_path, shared_data):
    from transformers import PreTrainedTokenizerFast

    from megatron.tokenizer.gpt2_bpe import _HFEngine, load_merges, load_vocab

    d = shared_data / "openwebtext-1000"
    engine = _HFEngine(load_vocab(str(d / "gpt2-tiny-vocab.json")), load_merges(str(d / "gpt2-tiny-merges.txt")))
    hf = PreTrainedTokenizerFast(tokenizer_object=engine._tok, eos_token="<|endoftext|>")
    hf.save_pretrained(tmp_path / "tok")
    args = _args(tokenizer_type="PretrainedFromHF", tokenizer_name_or_path=str(tmp_path / "tok"))
    tok = build_tokenizer(args)
    text = "Hello world, this is a test."
    assert tok.tokenize(text) == hf.encode(text) == GPT2BPETokenizer(
        str(d / "gpt2-tiny-vocab.json"), str(d / "gpt2-tiny-merges.txt")).tokenize(text)
    assert tok.tokenize_batch([text, "x"]) == [hf.encode(text), hf.encode("x")]
    assert tok.eod == tok.eos == 4999 and tok.vocab_size == 5000 and args.padded_vocab_size == 5120
    assert tok.detokenize(tok.tokenize(text)) == text
    extra = build_tokenizer(_args(tokenizer_type="PretrainedFromHF", tokenizer_name_or_path=str(tmp_path / "tok"),
                                  vocab_extra_ids=3))
    assert extra.vocab_size == 5003 and extra.additional_special_tokens_ids == [5000, 5001, 5002]
    with pytest.raises(RuntimeError, match="--tokenizer-name-or-path no-such-org/no-such-model") as info:
        build_tokenizer(_args(tokenizer_type="PretrainedFromHF", tokenizer_name_or_path="no-such-org/no-such-model"))
    assert "\n" not in str(info.value)


def test_no_torch_at_import():
    code = ("import sys; import megatron.tokenizer, megatron.data.indexed_dataset, megatron.data.preprocessing; "
            "from megatron.tokenizer import build_tokenizer; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-1000:]
