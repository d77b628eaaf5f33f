"""Scale + mask + softmax over attention scores (Megatron's FusedScaleMaskSoftmax), pure PyTorch.

The CUDA fused kernels are an optional later fast path; this module always computes
`softmax(mask_fill(scale * x, -10000))`, in fp32 when `softmax_in_fp32`, casting back to the input dtype.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron.model.enums import AttnMaskType


class FusedScaleMaskSoftmax(torch.nn.Module):
    """Megatron's constructor signature; `forward(input [b, np, sq, sk], mask bool [.., sq, sk] or None)`."""

    def __init__(
        self,
        input_in_fp16: bool,
        input_in_bf16: bool,
        attn_mask_type: AttnMaskType,
        scaled_masked_softmax_fusion: bool,
        mask_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        softmax_in_fp32: bool,
        scale: Optional[float],
    ) -> None:
        super().__init__()
        if input_in_fp16 and input_in_bf16:
            raise ValueError("FusedScaleMaskSoftmax: input cannot be both fp16 and bf16")
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        if not (scale is None or softmax_in_fp32):
            raise ValueError("softmax should be in fp32 when scaled (--attention-softmax-in-fp32)")

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        if input.dim() != 4:
            raise ValueError(f"FusedScaleMaskSoftmax expects [b, np, sq, sk] scores, got shape {tuple(input.shape)}")
        return self.forward_torch_softmax(input, mask)

    def forward_torch_softmax(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        orig_dtype = input.dtype
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        if mask is None and self.attn_mask_type == AttnMaskType.causal:
            sq, sk = input.shape[-2], input.shape[-1]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=input.device).triu(sk - sq + 1)
        if mask is not None:
            input = self.mask_func(input, mask)
        probs = torch.nn.Softmax(dim=-1)(input)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.to(orig_dtype)
        return probs
