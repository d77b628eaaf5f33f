"""vocab_parallel_cross_entropy: equals torch's cross entropy at TP=1, Megatron's label smoothing, TP=2 split."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from tests.dist_utils import run_distributed


def _data(vocab=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, vocab, generator=g) * 4 + 50  # big offset: needs the max subtraction
    target = torch.randint(0, vocab, (3, 5), generator=g)
    upstream = torch.rand(3, 5, generator=g)
    return logits, target, upstream


def _smoothed_reference(logits, target, smoothing):
    """Megatron's target distribution: 1 - s on the label, s / (K - 1) on every other token."""
    K = logits.size(-1)
    q = torch.full_like(logits, smoothing / (K - 1)).scatter(-1, target.unsqueeze(-1), 1.0 - smoothing)
    return -(q * torch.log_softmax(logits, dim=-1)).sum(-1)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_matches_reference_serial(smoothing):
    logits, target, upstream = _data()
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(a, target, None, smoothing)
    if smoothing:
        ref = _smoothed_reference(b, target, smoothing)
    else:
        ref = F.cross_entropy(b.reshape(-1, 12), target.reshape(-1), reduction="none").view(3, 5)
    (loss * upstream).sum().backward()
    (ref * upstream).sum().backward()
    assert torch.allclose(loss, ref, atol=1e-5)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert torch.equal(a.detach(), logits)  # the input logits are not modified in place


def test_shape_mismatch_is_clear():
    with pytest.raises(ValueError, match="does not match target shape"):
        tp.vocab_parallel_cross_entropy(torch.randn(2, 3, 8), torch.zeros(3, 2, dtype=torch.long))


def _ce_body(rank, world, smoothings):
    group = ps.initialize_model_parallel(world, 1).tp_group
    out = [_ce_case(rank, world, group, s) for s in smoothings]
    ps.destroy_model_parallel()
    return out


def _ce_case(rank, world, group, smoothing):
    logits, target, upstream = _data(vocab=8 * world, seed=3)
    full = logits.clone().requires_grad_()
    ref = tp.vocab_parallel_cross_entropy(full, target, None, smoothing)
    (ref * upstream).sum().backward()
    shard = torch.chunk(logits, world, dim=-1)[rank].clone().requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(shard, target, group, smoothing)
    (loss * upstream).sum().backward()
    return float((loss - ref).abs().max()), float((shard.grad - torch.chunk(full.grad, world, -1)[rank]).abs().max())


def test_tp2_equals_serial_with_and_without_smoothing():
    for per_rank in run_distributed(_ce_body, 2, args=([0.0, 0.15],)):
        for loss_err, grad_err in per_rank:
            assert loss_err < 1e-5 and grad_err < 1e-6


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_blocked_passes_bitwise_equal_one_block(monkeypatch, smoothing):
    """The forward's row blocks (a block size that does not divide the rows) give the same bits as one block."""
    from megatron.core.tensor_parallel import cross_entropy as ce

    logits, target, upstream = _data(vocab=37, seed=5)
    results = []
    for block_bytes in (1 << 30, 4 * 37 * 4):  # 15 rows: blocks of 4
        monkeypatch.setattr(ce, "_BLOCK_BYTES", block_bytes)
        x = logits.clone().requires_grad_()
        loss = tp.vocab_parallel_cross_entropy(x * 1.0, target, None, smoothing)
        loss.backward(upstream)
        results.append((loss.detach(), x.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
