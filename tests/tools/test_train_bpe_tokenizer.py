"""tools/train_bpe_tokenizer.py: the quick-start tokenizer loads as GPT2BPETokenizer with ids identical to HF."""
import json
import subprocess
import sys
import types

from megatron.tokenizer import build_tokenizer


def test_trained_vocab_matches_hf_and_roundtrips(tmp_path, repo_root):
    corpus = repo_root / "examples" / "data" / "python_docs.jsonl"
    out = tmp_path / "tok"
    proc = subprocess.run([sys.executable, str(repo_root / "tools" / "train_bpe_tokenizer.py"), "--input", str(corpus),
                           "--vocab-size", "1024", "--output-dir", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    vocab = json.loads((out / "vocab.json").read_text())
    assert len(vocab) == 1024 and "<|endoftext|>" in vocab

    args = types.SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(out / "vocab.json"),
                                 merge_file=str(out / "merges.txt"), make_vocab_size_divisible_by=128,
                                 tensor_model_parallel_size=1, rank=1, vocab_extra_ids=0)
    tok = build_tokenizer(args)
    assert tok.eod == vocab["<|endoftext|>"] and args.padded_vocab_size == 1024

    from transformers import GPT2TokenizerFast

    merges = [tuple(line.split()) for line in (out / "merges.txt").read_text().splitlines()[1:] if line]
    hf = GPT2TokenizerFast(vocab=vocab, merges=merges)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:20]]
    for text in texts:
        ids = tok.tokenize(text)
        assert ids == hf(text)["input_ids"]
        assert tok.detokenize(ids) == text


def test_bad_json_line_is_one_line_error(tmp_path, repo_root):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    proc = subprocess.run([sys.executable, str(repo_root / "tools" / "train_bpe_tokenizer.py"), "--input", str(bad),
                           "--output-dir", str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"{bad}:2:" in proc.stderr and "Traceback" not in proc.stderr
