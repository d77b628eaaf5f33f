"""Each Triton kernel of megatron/fused_kernels equals the pure-PyTorch path it replaces, forward and backward, on
CPU through Triton's interpreter: fp32 to a few ulps, fp16/bf16 to their rounding; odd sizes, masked rows, partial
rotary dims, strided views, vocabulary blocks and a TP=2 vocabulary split."""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from megatron import fused_kernels  # noqa: E402
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402
from megatron.layers.rotary import RotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

KERNEL_MODULES = ("softmax", "activations", "norms", "rope", "cross_entropy")
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-6), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _interpreted_kernels() -> None:
    """Import (or re-import, if something imported them before TRITON_INTERPRET was set) the kernel modules."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA machine: the kernels are compiled for the GPU (tests/gpu/ checks them there)")
    for name in KERNEL_MODULES:
        full = f"megatron.fused_kernels.{name}"
        module = sys.modules.get(full) or importlib.import_module(full)
        if not any(type(v).__name__ == "InterpretedFunction" for v in vars(module).values()):
            importlib.reload(module)


@pytest.fixture(autouse=True)
def interpreter():
    _interpreted_kernels()
    with fused_kernels.interpreter_on_cpu():
        yield


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _torch_softmax(x, mask, scale):
    s = x.float() * scale
    if mask is not None:
        s = s.masked_fill(mask, -10000.0)
    return torch.softmax(s, -1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scaled_masked_softmax(dtype):
    from megatron.fused_kernels.softmax import scaled_masked_softmax, scaled_upper_triang_masked_softmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 19, generator=g).to(dtype)
    mask = torch.rand(2, 1, 5, 19, generator=g) > 0.6
    mask[1, 0, 2] = True  # a fully masked row: uniform, as the torch path
    dy = torch.randn(2, 3, 5, 19, generator=g).to(dtype)
    causal = torch.ones(5, 19, dtype=torch.bool).triu(19 - 5 + 1)
    for fused, ref_mask in ((lambda t: scaled_masked_softmax(t, mask, 0.7), mask),
                            (lambda t: scaled_masked_softmax(t, None, 0.7), None),
                            (lambda t: scaled_upper_triang_masked_softmax(t, 0.7), causal)):
        a, b = _leaf(x), _leaf(x)
        y, ref = fused(a), _torch_softmax(b, ref_mask, 0.7)
        y.backward(dy)
        ref.backward(dy)
        assert y.dtype == dtype
        torch.testing.assert_close(y, ref, **TOL[dtype])
        torch.testing.assert_close(a.grad, b.grad, **TOL[dtype])
    assert torch.allclose(y[1, 0, 2].float(), torch.softmax(torch.zeros(19), -1).clone()) or ref_mask is causal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu_and_bias_swiglu(dtype, with_bias):
    from megatron.fused_kernels.activations import bias_gelu, bias_swiglu
    from megatron.layers.mlp import swiglu

    g = torch.Generator().manual_seed(1)
    for fused, ref_fn, width in ((bias_gelu, lambda t: F.gelu(t, approximate="tanh"), 37), (bias_swiglu, swiglu, 38)):
        x = (2 * torch.randn(3, 5, width, generator=g)).to(dtype)
        bias = torch.randn(width, generator=g).to(dtype) if with_bias else None
        xa, xb = _leaf(x), _leaf(x)
        ba, bb = (_leaf(bias), _leaf(bias)) if with_bias else (None, None)
        y = fused(xa, ba)
        ref = ref_fn(xb + bb if with_bias else xb)
        dy = torch.randn(ref.shape, generator=g).to(dtype)
        y.backward(dy)
        ref.backward(dy)
        torch.testing.assert_close(y, ref, **TOL[dtype])
        torch.testing.assert_close(xa.grad, xb.grad, **TOL[dtype])
        if with_bias:
            torch.testing.assert_close(ba.grad, bb.grad, **(TOL[dtype] if dtype == torch.float32 else
                                                             dict(rtol=5e-2, atol=1e-1)))


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16)])
def test_norm_modules(dtypes):
    """RMSNorm and MixedFusedLayerNorm (1p too) with the kernel selected vs the same module on the torch path."""
    from megatron.layers.fused_layer_norm import MixedFusedLayerNorm
    from megatron.layers.norms import RMSNorm

    x_dtype, p_dtype = dtypes
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, 37, generator=g).to(x_dtype)
    for module in (RMSNorm(37, eps=1e-5, params_dtype=p_dtype),
                   MixedFusedLayerNorm(37, eps=1e-5, params_dtype=p_dtype),
                   MixedFusedLayerNorm(37, eps=1e-5, apply_layernorm_1p=True, params_dtype=p_dtype)):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g).to(p_dtype))
        outs = []
        for fused in (True, False, None):  # None: the torch path in fp32 (the truth for bf16 parameter grads)
            dtype = torch.float32 if fused is None else p_dtype
            module.zero_grad()
            module.to(dtype)
            xa = _leaf(x.float() if fused is None else x)
            with fused_kernels.interpreter_on_cpu() if fused else _cpu_kernels_off():
                y = module(xa)
            y.backward(torch.linspace(-1, 1, y.numel()).view_as(y).to(y.dtype))
            outs.append([y, xa.grad] + [p.grad.clone() for p in module.parameters()])
        module.to(p_dtype)
        low = torch.bfloat16 in dtypes
        for fused_t, ref_t, truth in zip(*outs):
            assert fused_t.dtype == ref_t.dtype
            if fused_t.dim() == 1 and low:  # bf16 weight grads: torch sums rows in bf16, the kernel in fp32
                torch.testing.assert_close(fused_t.float(), truth, rtol=2e-2, atol=3e-2)
            else:
                torch.testing.assert_close(fused_t, ref_t, **TOL[torch.bfloat16 if low else torch.float32])


class _cpu_kernels_off:
    def __enter__(self):
        self.before = fused_kernels._CPU_INTERPRETER["on"]
        fused_kernels._CPU_INTERPRETER["on"] = False

    def __exit__(self, *exc):
        fused_kernels._CPU_INTERPRETER["on"] = self.before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 16), (20, 12)])
def test_rope_on_a_strided_view(dtype, head_dim, rotary_dim):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 3, 3, 3 * head_dim, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(rotary_dim).cos_sin(5, 2, qkv.device, dtype)  # with a KV-cache offset
    a, b = _leaf(qkv), _leaf(qkv)
    y = fused_kernels.apply_rope(a[..., head_dim:2 * head_dim], cos, sin)
    with _cpu_kernels_off():
        ref = apply_rotary_pos_emb(b[..., head_dim:2 * head_dim], cos, sin)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(y, ref, **TOL[dtype])
    torch.testing.assert_close(a.grad, b.grad, **TOL[dtype])


@pytest.mark.parametrize("vocab,block", [(37, 16), (64, 4096)])
def test_fused_cross_entropy_one_rank(monkeypatch, vocab, block):
    from megatron.fused_kernels import cross_entropy

    monkeypatch.setattr(cross_entropy, "_BLOCK", block)  # 37 over blocks of 16: the online max/sum across blocks
    g = torch.Generator().manual_seed(4)
    logits = 4 * torch.randn(4, 3, vocab, generator=g)
    target = torch.randint(0, vocab, (4, 3), generator=g)
    a, b = _leaf(logits), _leaf(logits)
    loss = vocab_parallel_cross_entropy(a, target)  # the seam picks the kernel here
    with _cpu_kernels_off():
        ref = vocab_parallel_cross_entropy(b, target)
    dl = torch.rand(4, 3, generator=g)
    loss.backward(dl)
    ref.backward(dl)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a, b)  # the logits are left as they were


def _ce_tp_body(rank, world_size, logits, target, dl):
    import torch.distributed as dist

    os.environ["TRITON_INTERPRET"] = "1"
    _interpreted_kernels()
    part = logits.size(-1) // world_size
    local = _leaf(logits[..., rank * part:(rank + 1) * part])
    with fused_kernels.interpreter_on_cpu():
        loss = vocab_parallel_cross_entropy(local, target, dist.group.WORLD)
    loss.backward(dl)
    return loss.detach(), local.grad


@pytest.mark.slow
def test_fused_cross_entropy_tp2_equals_serial():
    from tests.dist_utils import run_distributed

    g = torch.Generator().manual_seed(5)
    logits = 4 * torch.randn(3, 2, 30, generator=g)
    logits[0, 0, 20] = 30.0  # the max on one rank only
    target = torch.randint(0, 30, (3, 2), generator=g)
    dl = torch.rand(3, 2, generator=g)
    full = _leaf(logits)
    with _cpu_kernels_off():
        ref = vocab_parallel_cross_entropy(full, target)
    ref.backward(dl)
    results = run_distributed(_ce_tp_body, world_size=2, args=(logits, target, dl))
    for rank, (loss, grad) in enumerate(results):
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(grad, full.grad[..., rank * 15:(rank + 1) * 15], rtol=1e-6, atol=1e-7)
