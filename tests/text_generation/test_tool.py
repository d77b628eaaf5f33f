"""tools/generate_samples_gpt.py end to end: train a tiny GPT for 2 iterations (pretrain_gpt.py --save), then sample
from the checkpoint as a subprocess and compare with generate() on the same weights in this process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.presets import get_preset

MODEL = get_preset("gpt_micro_test").argv()
PROMPTS = ["The quick brown fox", "Hello", "In 1999 the company said that"]


def _run(repo_root: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo_root)}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def checkpoint(shared_data: Path, repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from megatron.data.indexed_dataset import index_file_path, make_builder
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

    owt = shared_data / "openwebtext-1000"
    vocab, merges = str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt")
    tok = GPT2BPETokenizer(vocab, merges)
    work = tmp_path_factory.mktemp("gen_tool")
    prefix = str(work / "owt_text_document")
    builder = make_builder(prefix + ".bin", impl="mmap", vocab_size=tok.vocab_size)
    with open(owt / "openwebtext-1000.jsonl") as f:
        for _, line in zip(range(20), f):
            builder.add_item(np.asarray(tok.tokenize(json.loads(line)["text"]) + [tok.eod], dtype=np.int64))
            builder.end_document()
    builder.finalize(index_file_path(prefix))
    tokenizer_flags = ["--vocab-file", vocab, "--merge-file", merges]
    proc = _run(repo_root, str(repo_root / "pretrain_gpt.py"), *MODEL, *tokenizer_flags, "--micro-batch-size", "2",
                "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--data-path", prefix,
                "--split", "100,0,0", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                "--save", str(work / "ckpt"), "--save-interval", "2", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (work / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return dict(dir=work, ckpt=str(work / "ckpt"), tok=tok, flags=MODEL + tokenizer_flags)


def _in_process_generate(checkpoint: dict, prompts: list[list[int]], n: int, **kw) -> dict:
    from megatron.arguments import core_transformer_config_from_args
    from megatron.models.gpt.model import GPTModel
    from megatron.text_generation import generate

    sd = torch.load(os.path.join(checkpoint["ckpt"], "iter_0000002", "mp_rank_00", "model_optim_rng.pt"),
                    weights_only=False)
    model = GPTModel(core_transformer_config_from_args(sd["args"]), parallel_output=False)
    model.load_state_dict(sd["model"])
    return generate(model.eval(), checkpoint["tok"], prompts, n, **kw)


def test_conditional_samples_match_in_process_generate(checkpoint, repo_root):
    work, tok = checkpoint["dir"], checkpoint["tok"]
    tool = str(repo_root / "tools" / "generate_samples_gpt.py")
    common = [tool, "--load", checkpoint["ckpt"], *checkpoint["flags"], "--sample-input-file", "prompts.txt",
              "--out-seq-length", "8", "--greedy", "--micro-batch-size", "3"]
    outs = []
    engine = ["--inference-dynamic-batching", "--inference-dynamic-batching-buffer-size-gb", "0.01",
              "--inference-dynamic-batching-block-size", "16"]
    for extra, name in (([], "kv.jsonl"), (["--recompute"], "recompute.jsonl"), (engine, "engine.jsonl")):
        proc = _run(repo_root, *common, *extra, "--sample-output-file", name, cwd=work)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append([json.loads(line) for line in (work / name).read_text().splitlines()])
    assert outs[0] == outs[1] == outs[2]  # KV cache, --recompute and the inference engine agree
    ids = [tok.tokenize(p) for p in PROMPTS]
    ref = _in_process_generate(checkpoint, ids, 8, greedy=True)
    for rec, prompt, p_ids, tokens in zip(outs[0], PROMPTS, ids, ref["tokens"]):
        assert rec["prompt"] == prompt and rec["tokens"] == tokens[len(p_ids):]
        assert 1 <= len(rec["tokens"]) <= 8 and rec["text"] == tok.detokenize(rec["tokens"])


def test_unconditional_samples_and_bad_input(checkpoint, repo_root):
    work = checkpoint["dir"]
    tool = str(repo_root / "tools" / "generate_samples_gpt.py")
    base = [tool, "--load", checkpoint["ckpt"], *checkpoint["flags"], "--out-seq-length", "6"]
    proc = _run(repo_root, *base, "--num-samples", "2", "--top_k", "5", "--seed", "3", "--genfile", "u.jsonl",
                "--micro-batch-size", "2", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in (work / "u.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(1 <= len(r["tokens"]) <= 6 for r in recs)
    proc = _run(repo_root, *base, "--sample-input-file", "missing.txt", cwd=work)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: --sample-input-file missing.txt: no such file"


def test_tool_under_torchrun_with_tp2(checkpoint, repo_root):
    """TP=2 checkpoint (pretrain_gpt.py under torchrun), sampled under torchrun with TP=2: same tokens as generate()
    on the merged TP=1 weights in this process."""
    from megatron.arguments import core_transformer_config_from_args
    from megatron.layers.tp_shards import merge_tensor_parallel_state_dicts
    from megatron.models.gpt.model import GPTModel, flatten_checkpoint_state_dict
    from megatron.text_generation import generate
    from tests.dist_utils import free_port

    work, tok = checkpoint["dir"], checkpoint["tok"]
    tp = [*checkpoint["flags"], "--tensor-model-parallel-size", "2"]

    def torchrun(*argv: str) -> None:
        proc = _run(repo_root, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(free_port()), *argv, cwd=work)
        assert proc.returncode == 0, proc.stderr[-3000:]

    torchrun(str(repo_root / "pretrain_gpt.py"), *tp, "--micro-batch-size", "2", "--global-batch-size", "2",
             "--train-iters", "2", "--lr", "1e-3", "--data-path", "owt_text_document", "--split", "100,0,0",
             "--eval-iters", "0", "--num-workers", "0", "--save", "ckpt_tp2", "--save-interval", "2")
    torchrun(str(repo_root / "tools" / "generate_samples_gpt.py"), *tp, "--load", "ckpt_tp2", "--sample-input-file",
             "prompts.txt", "--genfile", "tp2.jsonl", "--greedy", "--out-seq-length", "8", "--micro-batch-size", "3")
    shards = [torch.load(work / "ckpt_tp2" / "iter_0000002" / f"mp_rank_0{r}" / "model_optim_rng.pt",
                         weights_only=False) for r in range(2)]
    args = shards[0]["args"]
    args.tensor_model_parallel_size = 1
    model = GPTModel(core_transformer_config_from_args(args), parallel_output=False)
    model.load_state_dict(merge_tensor_parallel_state_dicts([flatten_checkpoint_state_dict(s["model"])
                                                             for s in shards]))
    ids = [tok.tokenize(p) for p in PROMPTS]
    ref = generate(model.eval(), tok, ids, 8, greedy=True)
    recs = [json.loads(line) for line in (work / "tp2.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in recs] == [t[len(i):] for t, i in zip(ref["tokens"], ids)]
