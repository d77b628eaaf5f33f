"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

Numerically stable: subtract the global max (all-reduce MAX), sum exp over the vocabulary (all-reduce SUM) and
pick the target logit on the rank that owns it (all-reduce SUM). Backward is (softmax - one_hot) on each rank's own
vocabulary slice, times the incoming per-token gradient.

Label smoothing follows Megatron's formula, loss = (1 - s') * nll - s' * mean_j log p_j with
s' = label_smoothing * K / (K - 1), but K and the mean are over the *full* vocabulary (Megatron uses the local
partition, which makes the smoothed loss depend on the TP size); at TP=1 both are identical.

On CUDA with Triton (and no label smoothing) the fused kernel of megatron/fused_kernels/cross_entropy.py runs
instead: it computes each rank's local max, sum of exp and target logit in one pass, never materialising the
softmax, and the same all-reduces combine them.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron import fused_kernels
from megatron.core.tensor_parallel.mappings import group_rank, group_size
from megatron.core.tensor_parallel.utils import VocabUtility


def _all_reduce_(t: torch.Tensor, group: Any, op: Any = None) -> None:
    if group_size(group) > 1:
        dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=group)


# Rows of logits handled together by the forward's passes: 32 rows of a 32k vocabulary are 4 MB, so after the first
# read (the max) a block stays in cache for the subtraction, exp, sum and (TP=1) normalisation, instead of five
# passes over the whole [tokens, V] tensor in memory (2,048 x 32k fp32 = 262 MB). Same ops per row: bitwise equal.
_BLOCK_BYTES = 4 << 20


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor, target: torch.Tensor, group: Any,
                label_smoothing: float) -> torch.Tensor:
        # In place (as Megatron-core) when the logits are an intermediate (the LM head's output): every new
        # [s, b, V] buffer costs page faults on CPU (glibc mmaps large blocks), ~0.3 s per step at V=50k, 2k tokens.
        if vocab_parallel_logits.grad_fn is None or not vocab_parallel_logits.is_contiguous():
            vocab_parallel_logits = vocab_parallel_logits.contiguous().clone()  # a leaf the caller may still use
        partition_vocab_size = vocab_parallel_logits.size(-1)
        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        rows = logits_2d.size(0)
        rank, world = group_rank(group), group_size(group)
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, rank, world
        )
        global_vocab = partition_vocab_size * world

        target_mask = (target < vocab_start) | (target >= vocab_end)
        masked_target = (target - vocab_start).masked_fill(target_mask, 0)
        masked_target_1d = masked_target.reshape(-1)

        # softmax(x) = exp(x - max) / sum exp(x - max), max and sum over the whole (all-reduced) vocabulary. With
        # one rank every pass runs block by block; with TP the max must be all-reduced before the subtraction and
        # the sum before the division, so those two are whole-tensor passes.
        local = world == 1
        logits_max = None if local else logits_2d.amax(dim=-1, keepdim=True)
        if logits_max is not None:
            _all_reduce_(logits_max, group, dist.ReduceOp.MAX)
        sum_exp_logits = logits_2d.new_empty(rows, 1)
        predicted_logits = logits_2d.new_empty(rows, 1)
        sum_logits = logits_2d.new_empty(rows) if label_smoothing > 0 else None
        block = max(1, _BLOCK_BYTES // max(1, partition_vocab_size * logits_2d.element_size()))
        for i in range(0, rows, block):
            j = min(rows, i + block)
            chunk = logits_2d[i:j]
            chunk.sub_(chunk.amax(dim=-1, keepdim=True) if local else logits_max[i:j])
            torch.gather(chunk, 1, masked_target_1d[i:j, None], out=predicted_logits[i:j])
            if sum_logits is not None:
                torch.sum(chunk, dim=-1, out=sum_logits[i:j])  # exp below overwrites the logits
            torch.exp(chunk, out=chunk)
            torch.sum(chunk, dim=-1, keepdim=True, out=sum_exp_logits[i:j])
            if local:
                chunk.div_(sum_exp_logits[i:j])
        predicted_logits = predicted_logits.view_as(target).masked_fill(target_mask, 0.0)
        _all_reduce_(predicted_logits, group)
        if not local:
            _all_reduce_(sum_exp_logits, group)
            logits_2d.div_(sum_exp_logits)
        softmax = vocab_parallel_logits
        sum_exp_logits = sum_exp_logits.view_as(target)

        log_sum_exp = torch.log(sum_exp_logits)
        loss = log_sum_exp - predicted_logits

        if label_smoothing > 0:
            if not 0.0 < label_smoothing < 1.0:
                raise ValueError(f"label smoothing must be in (0, 1), got {label_smoothing}")
            smoothing = label_smoothing * global_vocab / (global_vocab - 1)
            sum_log_probs = (sum_logits.view_as(target) - partition_vocab_size * log_sum_exp).contiguous()
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
    if label_smoothing == 0.0 and fused_kernels.runs_on(vocab_parallel_logits):
        partition = vocab_parallel_logits.size(-1)
        vocab_start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition, group_rank(tp_group), group_size(tp_group))
        return fused_kernels.vocab_parallel_cross_entropy(vocab_parallel_logits, target, vocab_start, tp_group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, label_smoothing)
