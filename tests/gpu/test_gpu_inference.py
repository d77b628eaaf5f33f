"""Inference and RNG on a GPU (skipped without CUDA): the CUDA RNG tracker, KV-cache generation, the REST server and
tasks/main.py zero-shot evaluation, each on CUDA and equal to the CPU run where the numbers must agree."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_manual_seed
from megatron.text_generation import generate
from tests.gpu.helpers import GPU, REPO
from tests.text_generation.helpers import PROMPTS, VOCAB, build_model

pytestmark = GPU
DEVICE = "cuda"


def _masks(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    get_cuda_rng_tracker().reset()
    model_parallel_manual_seed(seed, 0)
    x = torch.ones(4096, device=DEVICE)
    with get_cuda_rng_tracker().fork():
        tracked = torch.nn.functional.dropout(x, 0.5)
    return tracked, torch.nn.functional.dropout(x, 0.5)


def test_cuda_rng_tracker_reproducible_and_seed_dependent() -> None:
    a, b, c = _masks(1234), _masks(1234), _masks(4321)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # same seed: same masks, tracked and default
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])  # another seed: other masks
    assert not torch.equal(a[0], a[1])  # the model-parallel stream is not the default one
    get_cuda_rng_tracker().reset()


def test_kv_cache_generation_on_cuda() -> None:
    cpu_model = build_model()
    model = build_model().to(DEVICE)
    kw = dict(eod_id=VOCAB - 1, return_output_log_probs=True, use_eod_token_for_early_termination=False, greedy=True)
    cached = generate(model, None, PROMPTS, 12, use_kv_cache=True, **kw)
    recomputed = generate(model, None, PROMPTS, 12, use_kv_cache=False, **kw)
    on_cpu = generate(cpu_model, None, PROMPTS, 12, use_kv_cache=True, **kw)
    assert cached["tokens"] == recomputed["tokens"] == on_cpu["tokens"]
    for a, b in zip(cached["logprobs"], on_cpu["logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)


def test_rest_server_on_cuda(shared_data) -> None:
    from megatron.text_generation.server import build_server
    from tests.text_generation.test_server_http import put, tiny_gpt, tiny_tokenizer

    model, tokenizer = tiny_gpt().to(DEVICE), tiny_tokenizer(shared_data)
    server = build_server(model, tokenizer, max_sequence_length=64, max_tokens_to_generate=16, max_prompts=4,
                          max_request_bytes=4096, log=lambda line: None)
    address = server.start("127.0.0.1", 0)
    try:
        status, body = put(address, {"prompts": ["Hello world", "The GPU"], "tokens_to_generate": 8,
                                     "top_k": 1, "logprobs": True})
    finally:
        server.shutdown()
    assert status == 200, body
    assert len(body["text"]) == 2 and all(isinstance(t, str) for t in body["text"])
    assert all(math.isfinite(lp) for row in body["logprobs"] for lp in row)


def _wikitext(argv: list[str], env: dict) -> float:
    proc = subprocess.run([sys.executable, str(REPO / "tasks" / "main.py"), *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = re.search(r" validation results on WIKITEXT103 \| avg loss: (\S+) \|", proc.stdout)
    assert m, proc.stdout[-2000:]
    return float(m.group(1))


def test_tasks_main_zero_shot_on_cuda(shared_data, tmp_path: Path) -> None:
    from tests.tasks import helpers as H

    ckpt = H.save_megatron_checkpoint(H.random_state_dict(seed=0), tmp_path / "ckpt")
    wiki = H.write_wikitext_slice(shared_data, tmp_path / "wiki.test.tokens", 40)
    flags = H.model_flags(shared_data, ckpt)
    flags[flags.index("--distributed-backend") + 1] = "nccl"
    argv = ["--task", "WIKITEXT103", "--valid-data", str(wiki), "--micro-batch-size", "8", *flags]
    cuda_loss = _wikitext(argv, {})
    flags[flags.index("--distributed-backend") + 1] = "gloo"
    cpu_loss = _wikitext(["--task", "WIKITEXT103", "--valid-data", str(wiki), "--micro-batch-size", "8", *flags],
                         {"CUDA_VISIBLE_DEVICES": ""})
    assert cuda_loss == pytest.approx(cpu_loss, rel=1e-4)
    assert json.dumps(cuda_loss)  # a finite number
