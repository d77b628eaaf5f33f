"""--use-flash-attn: the attention path line printed at model build, the SDPA fallback equal to the explicit
softmax path on CPU, and the flash-attn call wiring (layout, causal, dropout, scale) through a fake module."""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.layers import attention
from megatron.layers.attention import CoreAttention, describe_attention_path
from megatron.layers.enums import AttnMaskType
from tests.model.helpers import tiny_config

SQ, B, NP, HN = 16, 2, 4, 8


@pytest.fixture(autouse=True)
def _fresh_flash_cache():
    attention.reset_flash_attn_cache()
    yield
    attention.reset_flash_attn_cache()


def _qkv(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(SQ, B, NP, HN, generator=g) for _ in range(3))


def _causal_mask() -> torch.Tensor:
    return torch.ones(1, 1, SQ, SQ, dtype=torch.bool).triu(1)


def _core(**overrides) -> CoreAttention:
    config = tiny_config(hidden_size=NP * HN, num_attention_heads=NP, **overrides)
    return CoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)


def _fake_flash_module(calls: list) -> types.ModuleType:
    """A stand-in for flash_attn 2.x: records its arguments and computes attention in its [b, s, h, d] layout."""
    module = types.ModuleType("flash_attn")
    module.__version__ = "2.9.fake"

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        calls.append(dict(shape=tuple(q.shape), dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                          contiguous=q.is_contiguous() and k.is_contiguous() and v.is_contiguous()))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale)
        return out.transpose(1, 2)

    module.flash_attn_func = flash_attn_func
    return module


def test_message_when_flash_attn_is_not_installed(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail like a missing package
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    core = _core(use_flash_attn=True)
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("> attention:")]
    assert lines == ["> attention: --use-flash-attn: the flash-attn package is not installed (pip install flash-attn); "
                     "using torch scaled_dot_product_attention (its fused flash kernel for CPU)"]
    assert not core.flash_attn_ready
    _core(use_flash_attn=True)  # a second layer / model does not print the line again
    assert "> attention:" not in capsys.readouterr().out


def test_message_without_the_flag(capsys) -> None:
    _core()
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("> attention:")]
    assert "scaled_dot_product_attention" in line and "--use-flash-attn not set" in line


def test_messages_with_flash_attn_installed(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module([]))
    ready, line = describe_attention_path(tiny_config(use_flash_attn=True, bf16=True), cuda=True)
    assert ready and line == "> attention: flash-attn 2.9.fake (CUDA, bf16)"
    ready, line = describe_attention_path(tiny_config(use_flash_attn=True, fp16=True), cuda=False)
    assert not ready and "flash-attn needs CUDA" in line and "fused flash kernel for CPU" in line
    ready, line = describe_attention_path(tiny_config(use_flash_attn=True), cuda=True)
    assert not ready and "fp16/bf16 only" in line and "fused kernels on CUDA" in line


def test_flash_flag_on_cpu_equals_explicit_softmax() -> None:
    """fp32 CPU: --use-flash-attn runs SDPA; it equals Megatron's explicit softmax path to 1e-5 (values and grads)."""
    q, k, v = _qkv()
    results = []
    for flash in (True, False):
        core = _core(use_flash_attn=flash).eval()
        core.allow_sdpa = flash
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = core(qq, kk, vv, _causal_mask())
        out.square().sum().backward()
        results.append((out.detach(), qq.grad, kk.grad, vv.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_flash_attn_call_wiring(monkeypatch) -> None:
    """The flash-attn call gets [b, s, h, d] contiguous tensors, causal=True, 1/sqrt(d) and the dropout rate."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(calls))
    core = _core(use_flash_attn=True, attention_dropout=0.1, bf16=True)
    attention._flash_attn()  # the fake module is what `flash_attn_func` resolves to
    q, k, v = _qkv(1)
    core.eval()
    out = core._flash(q, k, v)
    assert calls[-1] == dict(shape=(B, SQ, NP, HN), dropout_p=0.0, softmax_scale=1.0 / math.sqrt(HN), causal=True,
                             contiguous=True)
    explicit = _core().eval()
    explicit.allow_sdpa = False
    torch.testing.assert_close(out, explicit(q, k, v, _causal_mask()), rtol=1e-5, atol=1e-5)
    core.train()
    model_parallel_manual_seed(5, 0)
    core._flash(q, k, v)
    assert calls[-1]["dropout_p"] == 0.1
    # CPU fp32 tensors never reach flash-attn: the selector falls back to SDPA.
    assert not core._can_use_flash_attn(q, _causal_mask(), SQ, SQ)
