"""The activation-memory estimate (megatron/theoretical_memory_usage.py, Megatron's formula) against what CUDA's
allocator measures for one GPT forward pass (torch.cuda.max_memory_allocated), within 15%, without recomputation
and with selective and full recomputation. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from megatron.arguments import parse_args, validate_args
from megatron.theoretical_memory_usage import compute_activation_memory, model_config
from tests.gpu.helpers import GPU

pytestmark = GPU
DEVICE = "cuda"
MODEL = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
         "--micro-batch-size 4 --train-iters 1 --lr 1e-4 --bf16 --hidden-dropout 0.1 --attention-dropout 0.1")
RECOMPUTE = {"none": "", "selective": " --recompute-granularity selective",
             "full": " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"}


def _args(recompute: str):
    args = parse_args(args=(MODEL + RECOMPUTE[recompute]).split())
    args.world_size = 1
    validate_args(args)
    args.padded_vocab_size = 5120
    return args


def measured_forward_activation_bytes(args, device: str = DEVICE) -> float:
    """Peak bytes allocated during one training forward (dropout on: the explicit attention path Megatron's formula
    describes) above what was allocated before it."""
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.gpt.model import GPTModel

    model_parallel_manual_seed(1234, 0)
    model = GPTModel(model_config(args)).to(device).train()
    s, b = args.seq_length, args.micro_batch_size
    ids = torch.randint(0, 5000, (b, s), device=device)
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).triu(1)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    loss = model(ids, pos, mask, labels=ids)
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    loss.float().mean().backward()
    return float(peak)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_estimate_within_15_percent(recompute: str) -> None:
    args = _args(recompute)
    estimate = compute_activation_memory(args)
    measured = measured_forward_activation_bytes(args)
    assert measured == pytest.approx(estimate, rel=0.15), (recompute, measured / 2**20, estimate / 2**20)
