"""The output layer's pooled-buffer matmul: same values and gradients as F.linear, and live logits never reused."""
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import lm_head
from megatron.core.tensor_parallel.lm_head import lm_logits_linear


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, 8, generator=g, requires_grad=True)
    w = torch.randn(11, 8, generator=g, requires_grad=True)
    return x, w


def test_forward_and_backward_equal_f_linear():
    lm_head._POOL.clear()
    x, w = _inputs()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    gy = torch.randn(5, 3, 11)
    y = lm_logits_linear(x, w)
    y.backward(gy)
    y2 = F.linear(x2, w2)
    y2.backward(gy)
    torch.testing.assert_close(y, y2, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=1e-6)


def test_buffer_reused_only_when_nothing_holds_it():
    lm_head._POOL.clear()
    x, w = _inputs()
    first = lm_logits_linear(x, w)
    kept = first.detach().clone()
    second = lm_logits_linear(x * 2, w)  # `first` is still alive: must get another buffer
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(first, kept)  # untouched by the second call
    ptr = first.data_ptr()
    del first
    third = lm_logits_linear(x * 3, w)  # the first buffer is idle again: reused
    assert third.data_ptr() == ptr
    torch.testing.assert_close(third, F.linear(x * 3, w))


def test_saved_for_backward_blocks_reuse_until_backward_ran():
    lm_head._POOL.clear()
    x, w = _inputs()
    loss = lm_logits_linear(x, w).exp().sum()  # exp saves its output (the logits' successor), not the buffer...
    logits = lm_logits_linear(x, w)
    prob = torch.softmax(logits, dim=-1)  # ...softmax saves its output; the logits buffer itself stays referenced
    ptr = logits.data_ptr()
    other = lm_logits_linear(x + 1, w)
    assert other.data_ptr() != ptr
    loss.backward()
    assert torch.isfinite(prob).all()


def test_falls_back_with_bias_or_mixed_dtypes():
    x, w = _inputs()
    b = torch.randn(11)
    torch.testing.assert_close(lm_logits_linear(x, w, b), F.linear(x, w, b))
    out = lm_logits_linear(x.double(), w.double())
    assert out.dtype == torch.float64


def test_embedding_lookup_equals_f_embedding_bitwise_and_pools_the_grad():
    from megatron.core.tensor_parallel.lm_head import embedding_lookup

    lm_head._GRAD_POOL.clear()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 6, (4, 9), generator=g)  # repeated ids: the per-row sums must keep torch's order
    gy = torch.randn(4, 9, 8, generator=g)
    F.embedding(ids, w).backward(gy)
    ref = w.grad
    w.grad = None
    out = embedding_lookup(ids, w)
    out.backward(gy)
    assert torch.equal(out, F.embedding(ids, w)) and torch.equal(w.grad, ref)
    ptr = w.grad.data_ptr()
    kept, w.grad = w.grad, None
    embedding_lookup(ids, w).backward(gy)  # the first buffer is still held by `kept`: a fresh one
    assert torch.equal(kept, ref) and torch.equal(w.grad, ref) and w.grad.data_ptr() != ptr
    del kept
    w.grad = None
    embedding_lookup(ids, w).backward(gy)  # nothing holds the first buffer: reused, and zeroed first
    assert w.grad.data_ptr() == ptr and torch.equal(w.grad, ref)
