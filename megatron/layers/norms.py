"""The norm factory: every norm of a model (per layer and final) comes from `build_norm(config)`.

`LayerNorm` (Megatron's MixedFusedLayerNorm, optionally zero-centred with --apply-layernorm-1p) or `RMSNorm`
(``(x.float() * rsqrt(mean(x^2) + eps)).type_as(x) * weight``: the op order of Megatron-LM's legacy RMSNorm and of
Hugging Face's LlamaRMSNorm; on CUDA with Triton, megatron/fused_kernels/norms.py's kernel with the same numbers). Parameters carry `sequence_parallel` so training all-reduces their grads over TP.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.autograd.function import once_differentiable

from megatron import fused_kernels
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.fused_layer_norm import MixedFusedLayerNorm


class _RMSNormFP32(torch.autograd.Function):
    """weight * x * rsqrt(mean(x^2) + eps) for fp32 x and weight: the forward is the module's expression (same
    ops, same bits); the backward is the closed form (two passes over x instead of autograd's ten):
    d weight = sum(g * n), d x = r * (g w - n * mean(g w * n)) with n = x r. Equal to autograd's up to rounding."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (x * r)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        normed = x * r
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_output * normed).sum(dim=tuple(range(grad_output.dim() - 1)))
        grad_normed = grad_output * weight
        mean = (grad_normed * normed).mean(-1, keepdim=True)
        grad_input = grad_normed.sub_(normed.mul_(mean)).mul_(r)
        return grad_input, grad_weight, None


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm with a `weight` (no bias), computed in fp32 and returned in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype))
        self.weight.sequence_parallel = sequence_parallel

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_kernels.norm_fits(x.size(-1)) and fused_kernels.runs_on(x):
            return fused_kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and torch.is_grad_enabled():
            return _RMSNormFP32.apply(x, self.weight, self.eps)
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.type_as(x)
        return out if out.dtype == self.weight.dtype else out.to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


def norm_class(config: TransformerConfig) -> type:
    """The norm module class selected by `config.normalization`."""
    return RMSNorm if config.normalization == "RMSNorm" else MixedFusedLayerNorm


def build_norm(config: TransformerConfig, hidden_size: Optional[int] = None) -> torch.nn.Module:
    """The norm of `config` (LayerNorm | RMSNorm, epsilon, 1p, sequence parallel, params dtype)."""
    size = config.hidden_size if hidden_size is None else hidden_size
    kwargs = dict(eps=config.layernorm_epsilon, sequence_parallel=config.sequence_parallel,
                  params_dtype=config.params_dtype)
    if config.normalization == "RMSNorm":
        return RMSNorm(size, **kwargs)
    return MixedFusedLayerNorm(size, apply_layernorm_1p=config.apply_layernorm_1p, **kwargs)


def norm_kwargs(config: TransformerConfig) -> dict:
    """Constructor keyword arguments of `norm_class(config)` (used where a class and its arguments are needed)."""
    kwargs = dict(eps=config.layernorm_epsilon, sequence_parallel=config.sequence_parallel,
                  params_dtype=config.params_dtype)
    if config.normalization != "RMSNorm":
        kwargs["apply_layernorm_1p"] = config.apply_layernorm_1p
    return kwargs
