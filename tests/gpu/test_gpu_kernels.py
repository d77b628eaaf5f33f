"""Kernels on a GPU (skipped without CUDA): SDPA's flash and memory-efficient kernels against the explicit softmax
path, and each Triton kernel of megatron/fused_kernels against its pure-PyTorch reference, bf16 tolerances."""
from __future__ import annotations

import pytest
import torch

from megatron import fused_kernels
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.layers.attention import CoreAttention
from tests.gpu.helpers import GPU
from tests.model.helpers import batch, build_gpt, tiny_config

pytestmark = GPU + [pytest.mark.skipif(not fused_kernels.triton_importable(), reason="needs Triton")]
DEVICE = "cuda"
BF16 = dict(rtol=2e-2, atol=2e-2)
# Sizes: rows x columns large enough to fill the GPU's multiprocessors, odd where Megatron allows it.
SOFTMAX = (2, 8, 256, 256)
ROWS, HIDDEN, FFN = 1024, 2048, 2731
ROPE = (512, 2, 16, 128)
VOCAB = 50304


def _pair(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t.detach().clone().requires_grad_(), t.detach().clone().requires_grad_()


class _TorchOnly:
    """The pure-PyTorch path (MEGATRON_NO_TRITON=1) for the reference side."""

    def __enter__(self):
        self.patch = pytest.MonkeyPatch()
        self.patch.setenv(fused_kernels.DISABLE_ENV, "1")

    def __exit__(self, *exc):
        self.patch.undo()


def _compare(fused_fn, ref_fn, inputs: list[torch.Tensor], tol=BF16) -> None:
    a = [_pair(t) for t in inputs]
    out = fused_fn(*[x for x, _ in a])
    with _TorchOnly():
        ref = ref_fn(*[y for _, y in a])
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    for x, y in a:
        torch.testing.assert_close(x.grad.float(), y.grad.float(), **tol)


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
def test_sdpa_kernels_equal_the_explicit_path(backend: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build_gpt(tiny_config(hidden_size=128, num_attention_heads=4, bf16=True, params_dtype=torch.bfloat16))
    model = model.to(DEVICE)
    ids, pos, mask, labels = (t.to(DEVICE) for t in batch(seq=8))
    results = []
    for allow in (True, False):
        for m in model.modules():
            if isinstance(m, CoreAttention):
                m.allow_sdpa = allow
        model.zero_grad()
        with sdpa_kernel([getattr(SDPBackend, backend)] if allow else [SDPBackend.MATH]):
            loss = model(ids, pos, mask, labels=labels)
        loss.float().sum().backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_triton_softmax(causal: bool) -> None:
    from megatron.layers.enums import AttnMaskType
    from megatron.layers.fused_softmax import FusedScaleMaskSoftmax
    from megatron.layers.utils import attention_mask_func

    softmax = FusedScaleMaskSoftmax(False, True, AttnMaskType.causal if causal else AttnMaskType.padding, True,
                                    attention_mask_func, True, 2.0)
    x = torch.randn(*SOFTMAX, device=DEVICE, dtype=torch.bfloat16)
    mask = torch.rand(SOFTMAX[0], 1, *SOFTMAX[2:], device=DEVICE) > 0.7
    if causal:
        mask = None  # the upper-triangular kernel (with a mask the masked kernel runs)
    assert softmax.is_kernel_available(x, *x.shape)
    _compare(lambda t: softmax(t, mask), lambda t: softmax.forward_torch_softmax(t, mask), [x])


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_triton_bias_activations(kind: str) -> None:
    from megatron.layers.mlp import swiglu
    from megatron.layers.utils import gelu_impl

    width = FFN * (2 if kind == "swiglu" else 1)
    x = torch.randn(ROWS, width, device=DEVICE, dtype=torch.bfloat16)
    bias = torch.randn(width, device=DEVICE, dtype=torch.bfloat16)
    ref = (lambda t, b: gelu_impl(t + b)) if kind == "gelu" else (lambda t, b: swiglu(t + b))
    _compare(lambda t, b: fused_kernels.bias_activation(kind, t, b), ref, [x, bias],
             tol=dict(rtol=3e-2, atol=3e-1))  # the bias gradient sums 1024 bf16 rows


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_triton_norms(norm: str) -> None:
    from megatron.layers.norms import build_norm

    module = build_norm(tiny_config(hidden_size=HIDDEN, normalization=norm, params_dtype=torch.bfloat16)).to(DEVICE)
    x = torch.randn(ROWS, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    params = list(module.parameters())
    outs = []
    for disable in (False, True):
        module.zero_grad()
        xa = x.clone().requires_grad_()
        with _TorchOnly() if disable else torch.enable_grad():
            y = module(xa)
        y.backward(torch.ones_like(y))
        outs.append([y, xa.grad] + [p.grad.clone() for p in params])
    for a, b in zip(*outs):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=5e-1 if a.dim() == 1 else 3e-2)


def test_triton_rope() -> None:
    from megatron.layers.rotary import RotaryEmbedding, apply_rotary_pos_emb

    s, b, h, d = ROPE
    qkv = torch.randn(s, b, h, 3 * d, device=DEVICE, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(d).cos_sin(s, 0, torch.device(DEVICE), torch.bfloat16)
    _compare(lambda t: apply_rotary_pos_emb(t[..., d:2 * d], cos, sin),
             lambda t: apply_rotary_pos_emb(t[..., d:2 * d], cos, sin), [qkv])


def test_triton_cross_entropy() -> None:
    logits = 3 * torch.randn(ROWS, 2, VOCAB, device=DEVICE)
    target = torch.randint(0, VOCAB, (ROWS, 2), device=DEVICE)
    _compare(lambda t: vocab_parallel_cross_entropy(t, target), lambda t: vocab_parallel_cross_entropy(t, target),
             [logits], tol=dict(rtol=1e-5, atol=1e-5))


def test_start_up_line_on_this_gpu() -> None:
    assert fused_kernels.describe(tiny_config(bf16=True, params_dtype=torch.bfloat16)).startswith(
        "> fused kernels (Triton): masked-softmax")
