"""The output layer's matmul (hidden states -> vocabulary logits) and the embedding lookup, with their largest
buffers (the logits, the [V, h] weight gradients) reused across steps on CPU.

The logits are the largest tensor of a GPT step ([s, b, V]: 412 MB for 2,048 tokens and a 50k vocabulary). On the
CPU, glibc serves allocations that large with a fresh `mmap` each time, so every step pays page faults for it
(about 0.25 s a step at that size on 2 cores: a third of the matmul itself). The same holds, smaller, for the
gradients of the word embedding and of an untied output layer ([V, h]: 49 MB at 32k x 384, ~50 ms of page faults
each). CUDA's caching allocator already avoids this, so on GPUs these are plain `F.linear` / `F.embedding`.

A buffer is handed out again only when nothing else references its storage any more (autograd has released the
saved softmax and its gradient, the caller has dropped the logits, the optimizer has dropped `.grad`), so results are
never overwritten while alive; otherwise a new buffer is allocated, as without the pool.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class _BufferPool:
    """A few reusable CPU buffers, matched by shape and dtype."""

    def __init__(self, max_buffers: int = 2) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, use count when only the pool holds it)

    def get(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        for buf, idle_count in self._buffers:
            if buf.shape == shape and buf.dtype == dtype and _storage_use_count(buf.untyped_storage()._cdata) == idle_count:
                return buf.detach()  # a new tensor over the same storage; the pool's own one never gets a grad_fn
        buf = torch.empty(shape, dtype=dtype)
        if len(self._buffers) < self.max_buffers:
            self._buffers.append((buf, _storage_use_count(buf.untyped_storage()._cdata)))
            return buf.detach()
        return buf

    def clear(self) -> None:
        self._buffers.clear()


_POOL = _BufferPool()
_GRAD_POOL = _BufferPool()  # [V, h] weight gradients: the embedding's and an untied output layer's


class _LogitsMatmul(torch.autograd.Function):
    """logits = X Wᵀ written into a pooled buffer; the backward is the usual one."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input_, weight)
        out = _POOL.get(torch.Size((*input_.shape[:-1], weight.shape[0])), torch.result_type(input_, weight))
        torch.mm(input_.reshape(-1, input_.shape[-1]), weight.t(), out=out.view(-1, weight.shape[0]))
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        input_, weight = ctx.saved_tensors
        go2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = go2d.mm(weight).view_as(input_)
        if ctx.needs_input_grad[1]:
            grad_weight = _GRAD_POOL.get(weight.shape, go2d.dtype)
            torch.mm(go2d.t(), input_.reshape(-1, input_.shape[-1]), out=grad_weight)
        return grad_input, grad_weight


class _EmbeddingLookup(torch.autograd.Function):
    """`F.embedding(ids, weight)` whose weight gradient (zeros, then each token's row added in token order, as
    torch's CPU kernel) goes to a pooled buffer."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight_shape = weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        grad_weight = _GRAD_POOL.get(ctx.weight_shape, grad_output.dtype).zero_()
        grad_weight.index_add_(0, ids.reshape(-1), grad_output.reshape(-1, grad_output.size(-1)))
        return None, grad_weight


def lm_logits_linear(input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(input_, weight, bias)` for the output layer, with the pooled output buffer on CPU."""
    if (
        bias is not None
        or _storage_use_count is None
        or input_.device.type != "cpu"
        or weight.device.type != "cpu"
        or input_.dtype != weight.dtype
        or torch.is_autocast_enabled()
    ):
        return F.linear(input_, weight, bias)
    return _LogitsMatmul.apply(input_, weight)


def embedding_lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.embedding(ids, weight)`, with the weight gradient in a pooled buffer on CPU."""
    if (_storage_use_count is None or weight.device.type != "cpu" or not weight.requires_grad
            or not torch.is_grad_enabled() or ids.dtype not in (torch.int64, torch.int32)):
        return F.embedding(ids, weight)
    return _EmbeddingLookup.apply(ids, weight)
