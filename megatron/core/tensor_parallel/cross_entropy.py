"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

Numerically stable: subtract the global max (all-reduce MAX), sum exp over the vocabulary (all-reduce SUM) and
pick the target logit on the rank that owns it (all-reduce SUM). Backward is (softmax - one_hot) on each rank's own
vocabulary slice, times the incoming per-token gradient.

Label smoothing follows Megatron's formula, loss = (1 - s') * nll - s' * mean_j log p_j with
s' = label_smoothing * K / (K - 1), but K and the mean are over the *full* vocabulary (Megatron uses the local
partition, which makes the smoothed loss depend on the TP size); at TP=1 both are identical.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import group_rank, group_size
from megatron.core.tensor_parallel.utils import VocabUtility


def _all_reduce_(t: torch.Tensor, group: Any, op: Any = None) -> None:
    if group_size(group) > 1:
        dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor, target: torch.Tensor, group: Any,
                label_smoothing: float) -> torch.Tensor:
        logits_max = vocab_parallel_logits.max(dim=-1)[0].contiguous()
        _all_reduce_(logits_max, group, dist.ReduceOp.MAX)
        # In place (as Megatron-core) when the logits are an intermediate (the LM head's output): every new
        # [s, b, V] buffer costs page faults on CPU (glibc mmaps large blocks), ~0.3 s per step at V=50k, 2k tokens.
        if vocab_parallel_logits.grad_fn is None:  # a leaf (the caller may still use it): work on a copy
            vocab_parallel_logits = vocab_parallel_logits.clone()
        logits = vocab_parallel_logits.sub_(logits_max.unsqueeze(-1))

        partition_vocab_size = logits.size(-1)
        rank, world = group_rank(group), group_size(group)
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, rank, world
        )
        global_vocab = partition_vocab_size * world

        target_mask = (target < vocab_start) | (target >= vocab_end)
        masked_target = (target - vocab_start).masked_fill(target_mask, 0)
        logits_2d = logits.reshape(-1, partition_vocab_size)
        masked_target_1d = masked_target.reshape(-1)
        arange_1d = torch.arange(logits_2d.size(0), device=logits_2d.device)
        predicted_logits = logits_2d[arange_1d, masked_target_1d].masked_fill(target_mask.reshape(-1), 0.0)
        predicted_logits = predicted_logits.view_as(target).contiguous()
        _all_reduce_(predicted_logits, group)

        sum_logits = logits.sum(dim=-1) if label_smoothing > 0 else None  # exp below overwrites the logits
        exp_logits = torch.exp(logits, out=logits)
        sum_exp_logits = exp_logits.sum(dim=-1).contiguous()
        _all_reduce_(sum_exp_logits, group)

        log_sum_exp = torch.log(sum_exp_logits)
        loss = log_sum_exp - predicted_logits
        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))

        if label_smoothing > 0:
            if not 0.0 < label_smoothing < 1.0:
                raise ValueError(f"label smoothing must be in (0, 1), got {label_smoothing}")
            smoothing = label_smoothing * global_vocab / (global_vocab - 1)
            sum_log_probs = (sum_logits - partition_vocab_size * log_sum_exp).contiguous()
            _all_reduce_(sum_log_probs, group)
            loss = (1.0 - smoothing) * loss - smoothing * (sum_log_probs / global_vocab)

        ctx.label_smoothing = label_smoothing
        ctx.global_vocab = global_vocab
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax  # saved for this backward only: reuse it as the gradient buffer
        partition_vocab_size = softmax.size(-1)
        grad_2d = grad_input.view(-1, partition_vocab_size)
        arange_1d = torch.arange(grad_2d.size(0), device=grad_2d.device)
        owned = 1.0 - target_mask.reshape(-1).to(grad_2d.dtype)
        if ctx.label_smoothing > 0:
            smoothing = ctx.label_smoothing * ctx.global_vocab / (ctx.global_vocab - 1)
            grad_2d[arange_1d, masked_target_1d] -= (1.0 - smoothing) * owned
            grad_2d -= smoothing / ctx.global_vocab
        else:
            grad_2d[arange_1d, masked_target_1d] -= owned
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group: Any = None,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss [*target.shape] from logits [*target.shape, vocab/tp] (this rank's vocabulary slice).

    Compute it in fp32 for fp16/bf16 models (Megatron casts with `.float()` unless --fp16-lm-cross-entropy).
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits shape {tuple(vocab_parallel_logits.shape)} does not match "
            f"target shape {tuple(target.shape)} + [vocab/tp]"
        )
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, label_smoothing)
