"""LayerNorm under Megatron's `MixedFusedLayerNorm` name.

Pure PyTorch (`F.layer_norm`); inputs whose dtype differs from the parameters (fp32 residual stream with fp16/bf16
weights, Megatron's "mixed" case) are normalised in the input dtype and returned in the parameter dtype, as apex's
mixed-dtype kernel does.
On CUDA with Triton the Triton LayerNorm (megatron/fused_kernels/norms.py, same numbers) runs instead of F.layer_norm. Parameters carry `sequence_parallel` so training can all-reduce their grads over the TP group.
"""
from __future__ import annotations

import numbers
from typing import Sequence, Union

import torch
import torch.nn.functional as F

from megatron import fused_kernels


class MixedFusedLayerNorm(torch.nn.Module):
    """LayerNorm with Megatron's constructor and parameter names (`weight`, `bias`)."""

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        no_persist_layer_norm: bool = True,
        sequence_parallel: bool = False,
        apply_layernorm_1p: bool = False,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (int(normalized_shape),)
        self.normalized_shape = torch.Size(normalized_shape)
        self.eps = eps
        self.apply_layernorm_1p = apply_layernorm_1p
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(*self.normalized_shape, dtype=params_dtype))
        self.bias = torch.nn.Parameter(torch.empty(*self.normalized_shape, dtype=params_dtype))
        self.reset_parameters()
        self.weight.sequence_parallel = sequence_parallel
        self.bias.sequence_parallel = sequence_parallel

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.apply_layernorm_1p:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.apply_layernorm_1p else self.weight
        if len(self.normalized_shape) == 1 and fused_kernels.norm_fits(input.size(-1)) and fused_kernels.runs_on(input):
            out = fused_kernels.layer_norm(input, weight.to(input.dtype), self.bias.to(input.dtype), self.eps)
            return out if out.dtype == weight.dtype else out.to(weight.dtype)
        if input.dtype != weight.dtype:
            out = F.layer_norm(input, self.normalized_shape, weight.to(input.dtype), self.bias.to(input.dtype), self.eps)
            return out.to(weight.dtype)
        return F.layer_norm(input, self.normalized_shape, weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.normalized_shape)}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


# Megatron also exposes the plain name.
LayerNorm = MixedFusedLayerNorm
