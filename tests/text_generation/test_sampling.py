"""Sampling filters: top-k / top-p against straightforward references, temperature, vocab padding."""
from __future__ import annotations

import pytest
import torch

from megatron.text_generation.sampling import check_sampling_args, filter_top_k, filter_top_p, sample


def _reference_top_p(row: torch.Tensor, p: float) -> set[int]:
    """Smallest prefix of tokens (by descending probability) whose mass reaches p."""
    probs = row.softmax(-1)
    kept, mass = set(), 0.0
    for i in torch.argsort(probs, descending=True).tolist():
        kept.add(i)
        mass += probs[i].item()
        if mass >= p:
            break
    return kept


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_reference(p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    out = filter_top_p(logits.clone(), p)
    for row, ref_row in zip(out, logits):
        assert set(torch.nonzero(torch.isfinite(row)).view(-1).tolist()) == _reference_top_p(ref_row, p)


def test_top_k_keeps_k_largest():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    out = filter_top_k(logits.clone(), 7)
    for row, ref in zip(out, logits):
        assert set(torch.nonzero(torch.isfinite(row)).view(-1).tolist()) == set(torch.topk(ref, 7).indices.tolist())


def test_sampled_tokens_respect_filters_and_padding():
    logits = torch.randn(2000, 20, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(3)
    s = sample(logits, top_k=3, generator=g)
    top3 = torch.topk(logits, 3).indices
    assert bool((top3 == s[:, None]).any(1).all())
    s = sample(logits, vocab_size=10, generator=g)
    assert int(s.max()) < 10
    assert torch.equal(sample(logits, greedy=True), logits.argmax(-1))


def test_temperature_sharpens_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(20000, 3)
    counts = {}
    for t in (0.25, 4.0):
        s = sample(logits, temperature=t, generator=torch.Generator().manual_seed(0))
        counts[t] = torch.bincount(s, minlength=3).float() / s.numel()
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 0.25, 0)
    torch.testing.assert_close(counts[0.25], expected, atol=0.02, rtol=0)
    assert counts[4.0][0] < 0.5 < counts[0.25][0]


def test_bad_sampling_args():
    for kwargs in (dict(top_k=-1), dict(top_p=1.5), dict(top_k=2, top_p=0.5), dict(temperature=0.0)):
        with pytest.raises(ValueError):
            check_sampling_args(**{**dict(top_k=0, top_p=0.0, temperature=1.0), **kwargs})
