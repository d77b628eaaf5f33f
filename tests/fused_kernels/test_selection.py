"""Which path runs: the Triton kernels only on CUDA with Triton (faked here), Megatron's switches and size rules
deciding at each seam, the start-up line naming them; a tiny GPT (GeLU/LayerNorm and SwiGLU/RMSNorm/RoPE) gives the
same loss and gradients with every kernel selected (on CPU through the interpreter) as on the pure-PyTorch path."""
from __future__ import annotations

import pytest
import torch

from megatron import fused_kernels
from megatron.layers.enums import AttnMaskType
from megatron.layers.fused_softmax import FusedScaleMaskSoftmax
from megatron.layers.mlp import ParallelMLP
from megatron.layers.utils import attention_mask_func
from tests.model.helpers import batch, build_gpt, tiny_config


def test_without_cuda_or_triton_nothing_is_selected(monkeypatch):
    assert not fused_kernels.enabled(cuda=False, triton=True)
    assert not fused_kernels.enabled(cuda=True, triton=False)
    assert fused_kernels.enabled(cuda=True, triton=True)
    assert not fused_kernels.runs_on(torch.zeros(1))  # CPU tensors outside the tests' interpreter context
    monkeypatch.setenv(fused_kernels.DISABLE_ENV, "1")
    assert not fused_kernels.enabled(cuda=True, triton=True)
    assert fused_kernels.describe(tiny_config(), cuda=True, triton=True) == (
        "> fused kernels: none (pure PyTorch paths: MEGATRON_NO_TRITON is set)")


def test_start_up_line_names_the_active_kernels():
    assert fused_kernels.describe(tiny_config(), cuda=False) == "> fused kernels: none (pure PyTorch paths: no CUDA)"
    assert "Triton is not installed" in fused_kernels.describe(tiny_config(), cuda=True, triton=False)
    line = fused_kernels.describe(tiny_config(bf16=True, params_dtype=torch.bfloat16), cuda=True, triton=True)
    assert line == ("> fused kernels (Triton): masked-softmax (explicit attention path, shapes permitting), bias-gelu, "
                    "layernorm, vocab-parallel cross entropy (no label smoothing)")
    llama = tiny_config(swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                        bias_swiglu_fusion=False, masked_softmax_fusion=False, bf16=True, params_dtype=torch.bfloat16)
    line = fused_kernels.describe(llama, cuda=True, triton=True)
    assert line == ("> fused kernels (Triton): rmsnorm, rope, vocab-parallel cross entropy (no label smoothing); off: "
                    "masked-softmax (--no-masked-softmax-fusion); bias-swiglu (--no-bias-swiglu-fusion)")
    assert "bias-gelu (erf GeLU" in fused_kernels.describe(tiny_config(bias_gelu_fusion=False), cuda=True, triton=True)


def test_mlp_seam_keeps_megatrons_activation_meaning():
    assert ParallelMLP(tiny_config()).fused_bias_activation == "gelu"  # tanh GeLU, Megatron's fused bias_gelu
    erf = ParallelMLP(tiny_config(bias_gelu_fusion=False))
    assert erf.fused_bias_activation is None and erf.activation_name == "gelu"  # --no-bias-gelu-fusion: erf GeLU
    assert ParallelMLP(tiny_config(openai_gelu=True)).fused_bias_activation is None
    assert ParallelMLP(tiny_config(swiglu=True)).fused_bias_activation == "swiglu"
    assert ParallelMLP(tiny_config(swiglu=True, bias_swiglu_fusion=False)).fused_bias_activation is None


@pytest.mark.parametrize("shape,causal,fusion,dtype,expected", [
    ((2, 2, 32, 32), True, True, torch.bfloat16, True),
    ((2, 2, 32, 32), False, True, torch.float16, True),
    ((2, 2, 8, 16), False, True, torch.bfloat16, False),    # sk <= 16
    ((1, 1, 4, 4100), False, True, torch.bfloat16, False),  # sk > 4096
    ((2, 2, 30, 32), False, True, torch.bfloat16, False),   # sq % 4
    ((1, 3, 32, 32), False, True, torch.bfloat16, False),   # b * np % 4
    ((2, 2, 16, 32), True, True, torch.bfloat16, False),    # causal kernel needs sq == sk
    ((2, 2, 32, 32), True, False, torch.bfloat16, False),   # --no-masked-softmax-fusion
    ((2, 2, 32, 32), True, True, torch.float32, False),     # fp32 scores: Megatron's torch path
])
def test_softmax_size_rules(monkeypatch, shape, causal, fusion, dtype, expected):
    monkeypatch.setattr(fused_kernels, "runs_on", lambda t: True)  # a faked CUDA + Triton capability
    softmax = FusedScaleMaskSoftmax(dtype == torch.float16, dtype == torch.bfloat16,
                                    AttnMaskType.causal if causal else AttnMaskType.padding, fusion,
                                    attention_mask_func, True, None)
    assert softmax.is_kernel_available(torch.zeros(1, dtype=dtype), *shape) is expected


def _loss_and_grads(model, kernels: bool):
    ids, pos, mask, labels = batch()
    model.zero_grad()
    ctx = fused_kernels.interpreter_on_cpu() if kernels else torch.enable_grad()
    with ctx:
        loss = model(ids, pos, mask, labels=labels)
        loss.sum().backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("overrides", [{}, dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                                                add_bias_linear=False)])
def test_tiny_gpt_equal_with_every_kernel_selected(monkeypatch, overrides):
    pytest.importorskip("triton")
    from tests.fused_kernels.test_triton_kernels import _interpreted_kernels

    _interpreted_kernels()
    calls = {}
    for name in ("layer_norm", "rms_norm", "apply_rope", "bias_activation", "vocab_parallel_cross_entropy"):
        def counted(*args, _name=name, _fn=getattr(fused_kernels, name)):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args)
        monkeypatch.setattr(fused_kernels, name, counted)
    model = build_gpt(tiny_config(**overrides))
    fused = _loss_and_grads(model, True)
    norm = "rms_norm" if overrides else "layer_norm"
    expected = {norm: 5, "bias_activation": 2, "vocab_parallel_cross_entropy": 1}  # 2 layers: 2 norms each + final
    if overrides:
        expected["apply_rope"] = 4  # q and k of 2 layers
    assert calls == expected
    ref = _loss_and_grads(model, False)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_softmax_seam_runs_the_kernel():
    pytest.importorskip("triton")
    from tests.fused_kernels.test_triton_kernels import _interpreted_kernels

    _interpreted_kernels()
    softmax = FusedScaleMaskSoftmax(False, True, AttnMaskType.padding, True, attention_mask_func, True, 2.0)
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 2, 4, 20, generator=g).to(torch.bfloat16)
    mask = torch.rand(2, 1, 4, 20, generator=g) > 0.5
    with fused_kernels.interpreter_on_cpu():
        assert softmax.is_kernel_available(scores, *scores.shape)
        fused = softmax(scores, mask)
    torch.testing.assert_close(fused, softmax.forward_torch_softmax(scores.clone(), mask), rtol=2e-2, atol=4e-3)
    # Causal with a reset-attention-mask style document mask: the mask is read (Megatron's kernel would ignore it).
    causal = FusedScaleMaskSoftmax(False, True, AttnMaskType.causal, True, attention_mask_func, True, None)
    scores = torch.randn(2, 2, 20, 20, generator=g).to(torch.bfloat16)
    docs = torch.ones(20, 20, dtype=torch.bool).triu(1).expand(2, 1, 20, 20).clone()
    docs[:, :, 8:, :8] = True
    with fused_kernels.interpreter_on_cpu():
        fused = causal(scores, docs)
    torch.testing.assert_close(fused, causal.forward_torch_softmax(scores.clone(), docs), rtol=2e-2, atol=4e-3)
    assert fused[0, 0, 10, :8].abs().max() == 0
