"""megatron.core.utils and tensor_parallel.utils helpers."""
from __future__ import annotations

import pytest
import torch

from megatron.core import tensor_parallel as tp
from megatron.core.utils import divide, get_attr_wrapped_model, make_viewless_tensor, unwrap_model


def test_divide_and_clear_error():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="hidden size: 10 is not divisible by 4"):
        divide(10, 4, "hidden size")
    with pytest.raises(ValueError, match="not divisible"):
        tp.divide(3, 0)


def test_split_helpers_and_vocab_ranges():
    t = torch.arange(24.0).view(2, 12)
    parts = tp.split_tensor_along_last_dim(t, 3, contiguous_split_chunks=True)
    assert [p.shape for p in parts] == [(2, 4)] * 3 and torch.equal(torch.cat(parts, -1), t)
    assert all(p.is_contiguous() for p in parts)
    assert tp.VocabUtility.vocab_range_from_global_vocab_size(64, 2, 4) == (32, 48)
    assert tp.VocabUtility.vocab_range_from_per_partition_vocab_size(10, 1, 2) == (10, 20)
    assert torch.equal(tp.split_tensor_into_1d_equal_chunks(t, None), t.view(-1))


def test_make_viewless_tensor_keeps_values_and_graph():
    base = torch.randn(4, 6, requires_grad=True)
    view = (base * 2)[1:3]
    assert view._base is not None
    detached = make_viewless_tensor(view, requires_grad=False, keep_graph=False)
    assert detached._base is None and torch.equal(detached, view)
    kept = make_viewless_tensor(view, requires_grad=True, keep_graph=True)
    assert kept._base is None and torch.equal(kept, view)
    kept.sum().backward()
    assert torch.equal(base.grad[1:3], torch.full((2, 6), 2.0)) and base.grad[0].abs().sum() == 0


def test_unwrapping_models():
    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    inner = torch.nn.Linear(2, 2)
    inner.marker = "x"
    wrapped = Wrapper(Wrapper(inner))
    assert unwrap_model(wrapped) is inner and unwrap_model([wrapped]) == [inner]
    assert get_attr_wrapped_model(wrapped, "marker") == "x"
    with pytest.raises(RuntimeError, match="couldn't find attribute"):
        get_attr_wrapped_model(wrapped, "nope")
