"""What a schedule back-propagates from one micro-batch's loss function output (Megatron-LM's forward_step rule).

A loss function returns ``(loss, {name: value})`` (the mean of the micro-batch's token losses: the schedule divides
it by the number of micro-batches) or Megatron's three values ``(sum of token losses, number of tokens,
{name: [sum, count]})``: divided by the tokens and the micro-batches, or with --calculate-per-token-loss not
divided at all -- the tokens are summed over the micro-batches (`num_tokens`) and the gradients divided by the
global batch's tokens after the data-parallel reduction (megatron/core/distributed/finalize_model_grads.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch


def micro_batch_loss(outputs: tuple, num_microbatches: int, calculate_per_token_loss: bool,
                     num_tokens: Optional[torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """(the tensor to back-propagate, the reduced values to log) of one loss-function output; adds the
    micro-batch's token count into `num_tokens` (a 0-d tensor, in place) for three-value outputs."""
    if len(outputs) == 2:
        if calculate_per_token_loss:
            raise ValueError("--calculate-per-token-loss needs a loss function returning (sum of token losses, "
                             "number of tokens, {name: [sum, count]}) as Megatron-LM's pretrain_gpt.py does")
        loss, reduced = outputs
        return loss / num_microbatches, reduced
    loss, tokens, reduced = outputs
    if num_tokens is not None:
        num_tokens += tokens.detach().to(num_tokens.device, num_tokens.dtype)
    if calculate_per_token_loss:
        return loss, reduced
    return loss / torch.clamp(tokens, min=1) / num_microbatches, reduced


def aux_loss_divisor(num_microbatches: int, calculate_per_token_loss: bool) -> int:
    """What the auxiliary (MoE, MTP) losses' backward scale is divided by: the micro-batches, or 1 per token."""
    return 1 if calculate_per_token_loss else num_microbatches
