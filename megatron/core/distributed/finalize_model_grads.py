"""Gradient reductions that follow the backward pass of all micro-batches (Megatron's order):

1. data-parallel reduction of each chunk (`finish_grad_sync()` of the local DDP: waits for the buckets that
   --overlap-grad-reduce launched during backward and reduces the rest; all-reduce, or reduce-scatter with the
   distributed optimizer; `allreduce_gradients()` of other wrappers);
2. with sequence parallelism, all-reduce over the TP group the grads of params marked `sequence_parallel`
   (LayerNorm weights/biases whose inputs were split along the sequence), and always those marked
   `tensor_parallel_partial_grad` (--qk-layernorm's norms: each TP rank normalises its own heads);
3. with pipeline parallelism and tied embeddings (or multi-token prediction), all-reduce the word-embedding grad between the first and last
   stage over the embedding group (with an encoder-and-decoder split rank R the group is {first, R, last}, and the
   position-embedding grads of stages 0 and R are summed too);
4. the per-iteration updates modules declare (megatron/core/step_updates.py: the MoE router's expert bias), their
   counts summed over TP and the data-parallel-with-CP group, as Megatron-LM's _update_router_expert_bias.
With --calculate-per-token-loss (`num_tokens`) the grads are divided by the global batch's token count before 4.
Grads are read from `param.main_grad` when the local DDP provides it, else `param.grad`.

Steps 2 and 3 are sums, so they commute with the data-parallel average. With the distributed optimizer (only this
rank's shard of each bucket is averaged) they stay correct because every TP rank has the same buffer layout and the
tied embedding has a bucket of its own, sharded identically on the first and the last stage.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.step_updates import apply_step_updates
from megatron.core.utils import flatten_dense_tensors, unflatten_dense_tensors
from megatron.core.utils import unwrap_model as _unwrap


def _grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad




def _active(group) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def allreduce_sequence_parallel_grads(model_chunks: Sequence[torch.nn.Module], tp_group,
                                      sequence_parallel: bool = True) -> None:
    """Sum grads of `sequence_parallel` params (when `sequence_parallel`) and of `tensor_parallel_partial_grad`
    params over the tensor-parallel group (one coalesced collective)."""
    if not _active(tp_group):
        return
    grads: List[torch.Tensor] = []
    for chunk in model_chunks:
        for param in chunk.parameters():
            partial = getattr(param, "tensor_parallel_partial_grad", False) or (
                sequence_parallel and getattr(param, "sequence_parallel", False))
            if param.requires_grad and partial:
                grad = _grad(param)
                if grad is not None:
                    grads.append(grad.data)
    if not grads:
        return
    coalesced = flatten_dense_tensors(grads)
    dist.all_reduce(coalesced, group=tp_group)
    for buf, synced in zip(grads, unflatten_dense_tensors(coalesced, grads)):
        buf.copy_(synced)


def allreduce_embedding_grads(model_chunks: Sequence[torch.nn.Module], parallel_state) -> None:
    """Sum the tied word-embedding grad between the first and last pipeline stage."""
    if parallel_state is None or parallel_state.pp_size <= 1:
        return
    if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    if not _active(parallel_state.embedding_group):
        return
    if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        chunk = model_chunks[0]
    elif parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        chunk = model_chunks[-1]
    else:
        chunk = model_chunks[0]
    model = _unwrap(chunk)
    getter = getattr(model, "shared_embedding_or_output_weight", None) or getattr(model, "word_embeddings_weight", None)
    if getter is None:
        return
    config = getattr(model, "config", None)
    share = getattr(model, "share_embeddings_and_output_weights",
                    getattr(model, "share_word_embeddings", getattr(config, "share_embeddings_and_output_weights", True)))
    if not share and not getattr(config, "mtp_num_layers", None):  # MTP embeds on the last stage, tied or not
        return
    weight = getter()
    if weight is None:
        return
    grad = _grad(weight)
    if grad is None:
        raise RuntimeError(
            "tied word embedding has no gradient on this pipeline stage; run backward before finalize_model_grads"
        )
    dist.all_reduce(grad, group=parallel_state.embedding_group)


def allreduce_position_embedding_grads(model_chunks: Sequence[torch.nn.Module], parallel_state) -> None:
    """Sum the position-embedding grad of the encoder's (stage 0) and the decoder's (split stage R) embedding over
    the position-embedding group {0, R} (encoder-and-decoder pipelines with a split rank only)."""
    if parallel_state is None or parallel_state.pp_size <= 1 or \
            getattr(parallel_state, "pipeline_split_rank", None) is None:
        return
    if not parallel_state.is_rank_in_position_embedding_group() or not _active(
            parallel_state.position_embedding_group):
        return
    embedding = getattr(getattr(_unwrap(model_chunks[0]), "language_model", None), "embedding", None)
    weight = getattr(getattr(embedding, "position_embeddings", None), "weight", None)
    if weight is None:
        return
    grad = _grad(weight)
    if grad is None:
        raise RuntimeError("position embedding has no gradient on this pipeline stage; run backward before "
                           "finalize_model_grads")
    dist.all_reduce(grad, group=parallel_state.position_embedding_group)


def scale_by_num_tokens(model_chunks: Sequence[torch.nn.Module], parallel_state,
                        num_tokens: torch.Tensor) -> torch.Tensor:
    """--calculate-per-token-loss: the global batch's token count (this rank's sum over its micro-batches, taken
    from the last pipeline stage, summed over the data-parallel-with-CP group) and every grad scaled so the
    data-parallel average becomes the sum over that group divided by it (Megatron-LM's finalize_model_grads)."""
    if parallel_state is not None and _active(parallel_state.pp_group):
        dist.broadcast(num_tokens, src=parallel_state.pp_last_rank(), group=parallel_state.pp_group)
    group = None if parallel_state is None else parallel_state.dp_cp_group
    if _active(group):
        dist.all_reduce(num_tokens, group=group)
    averaged_over = dist.get_world_size(group) if _active(group) else 1  # the DDP wrappers divide by it
    if int(num_tokens) > 0:
        factor = averaged_over / float(num_tokens)
        for chunk in model_chunks:
            for param in chunk.parameters():
                grad = _grad(param)
                if grad is not None:
                    grad.mul_(factor)
    return num_tokens


def finalize_model_grads(model_chunks: Sequence[torch.nn.Module], parallel_state=None,
                         sequence_parallel: bool = False, num_tokens: Optional[torch.Tensor] = None) -> None:
    """Run all post-backward reductions for `model_chunks` (DDP-wrapped or plain modules); with `num_tokens`
    (--calculate-per-token-loss) then divide the grads by the global batch's tokens (`scale_by_num_tokens`)."""
    for chunk in model_chunks:
        reduce = getattr(chunk, "finish_grad_sync", None) or getattr(chunk, "allreduce_gradients", None)
        if reduce is not None:
            reduce()
    if parallel_state is not None:
        allreduce_sequence_parallel_grads(model_chunks, parallel_state.tp_group, sequence_parallel)
    allreduce_embedding_grads(model_chunks, parallel_state)
    allreduce_position_embedding_grads(model_chunks, parallel_state)
    if num_tokens is not None:
        scale_by_num_tokens(model_chunks, parallel_state, num_tokens)
    groups = () if parallel_state is None else (parallel_state.tp_group, parallel_state.dp_cp_group)
    apply_step_updates(model_chunks, groups)
