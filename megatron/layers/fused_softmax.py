"""Scale + mask + softmax over attention scores (Megatron's FusedScaleMaskSoftmax), pure PyTorch.

Computes `softmax(mask_fill(scale * x, -10000))`, in fp32 when `softmax_in_fp32`, casting back to the input dtype.
On CUDA with Triton, Megatron's fused kernels' rule (`is_kernel_available`) picks the Triton scaled (causal) masked
softmax of megatron/fused_kernels/softmax.py, which gives the same numbers.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron import fused_kernels
from megatron.layers.enums import AttnMaskType
from megatron.layers.utils import attention_mask_func


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

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor],
                softmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Probabilities [b, np, sq, sk] of scores `input`; with `softmax_offset` [np] (attention sinks,
        --softmax-type) each row's denominator also holds exp(offset of its head) (the torch path)."""
        if input.dim() != 4:
            raise ValueError(f"FusedScaleMaskSoftmax expects [b, np, sq, sk] scores, got shape {tuple(input.shape)}")
        if softmax_offset is None and self.is_kernel_available(input, *input.size()):
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask, softmax_offset)

    def is_kernel_available(self, input: torch.Tensor, b: int, np: int, sq: int, sk: int) -> bool:
        """Megatron's size rule (fused_kernels.softmax_fits) on a device where the Triton kernels run; only with
        Megatron's own mask function (-10000 fill), which the kernel implements."""
        causal = self.attn_mask_type == AttnMaskType.causal
        return (self.mask_func is attention_mask_func and fused_kernels.runs_on(input)
                and fused_kernels.softmax_fits(self.scaled_masked_softmax_fusion, self.input_in_float16, causal,
                                               b, np, sq, sk))

    def forward_fused_softmax(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        scale = self.scale if self.scale is not None else 1.0
        # Megatron's causal kernel ignores the mask tensor (wrong for reset-attention-mask documents); ours uses the
        # causal kernel only when there is no mask and otherwise reads the mask, so it always equals the torch path.
        causal = self.attn_mask_type == AttnMaskType.causal and mask is None
        return fused_kernels.masked_softmax(input, mask, scale, causal)

    def forward_torch_softmax(self, input: torch.Tensor, mask: Optional[torch.Tensor],
                              softmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
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
        if softmax_offset is None:
            probs = torch.nn.Softmax(dim=-1)(input)
        else:
            probs = softmax_with_sink(input, softmax_offset)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.to(orig_dtype)
        return probs


def softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] without the sink column: scores [b, np, sq, sk], sink [np] one logit per head
    (Megatron-LM core's SoftmaxOne: off-by-one with zeros, GPT-OSS's learned sinks)."""
    b, np_, sq, _ = scores.shape
    column = sink.to(device=scores.device, dtype=scores.dtype).reshape(1, np_, 1, 1).expand(b, np_, sq, 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
