"""Micro-batch schedules: run forward (and backward) over ``num_microbatches`` micro-batches of one global batch.

Same contract as Megatron-LM: ``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`` and
``loss_func(output_tensor) -> (loss, {name: reduced_value})``. The schedule divides each micro-batch loss by
``num_microbatches`` before backward, so the accumulated gradient is the mean over micro-batches, and returns the
list of the reduced-loss dicts for logging (filled on the last pipeline stage only).

Pipelined schedules (``pipelined.py``): 1F1B (``forward_backward_pipelining_without_interleaving``) and interleaved
1F1B over virtual stages (``forward_backward_pipelining_with_interleaving``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Union

import torch

from megatron.core import aux_losses
from megatron.core.pipeline_parallel import pipelined
from megatron.core.pipeline_parallel.losses import aux_loss_divisor, micro_batch_loss

ForwardStepFunc = Callable[[Optional[Iterator], torch.nn.Module], tuple[torch.Tensor, Callable]]


def _single(model: Union[torch.nn.Module, list]) -> torch.nn.Module:
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("the non-pipelined schedule takes one model chunk; "
                             "--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1")
        return model[0]
    return model


def _forward_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: Optional[Iterator],
    model: torch.nn.Module,
    num_microbatches: int,
    forward_data_store: list,
    collect_non_loss_data: bool,
    calculate_per_token_loss: bool = False,
    num_tokens: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    if collect_non_loss_data:
        forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        return None
    loss, loss_reduced = micro_batch_loss(loss_func(output_tensor), num_microbatches, calculate_per_token_loss,
                                          num_tokens)
    forward_data_store.append(loss_reduced)
    return loss


def _backward_step(output_tensor: torch.Tensor, grad_scale_func: Optional[Callable]) -> None:
    if grad_scale_func is not None:
        output_tensor = grad_scale_func(output_tensor)
    torch.autograd.backward(output_tensor)


def forward_backward_no_pipelining(
    forward_step_func: ForwardStepFunc,
    data_iterator: Optional[Iterator],
    model: Union[torch.nn.Module, list],
    num_microbatches: int,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    calculate_per_token_loss: bool = False,
    num_tokens: Optional[torch.Tensor] = None,
    **unused: Any,
) -> list:
    """Forward (+ backward unless ``forward_only``) over the micro-batches; returns the per-micro-batch loss dicts.

    ``grad_scale_func`` (the optimizer's ``scale_loss``) multiplies the loss by the fp16 loss scale before backward.
    With ``calculate_per_token_loss`` the micro-batch losses are sums, not divided (losses.py), and their token
    counts are added into ``num_tokens``. Gradients of all but the last micro-batch are accumulated under the model's ``no_sync()`` when it has one
    (torch DDP; the local DDP, whose --overlap-grad-reduce starts the bucket reductions during the last
    micro-batch's backward), so gradients are reduced once per global batch.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    model = _single(model)
    aux_losses.set_scale_for_schedule(aux_loss_divisor(num_microbatches, calculate_per_token_loss), grad_scale_func)
    per_token = dict(calculate_per_token_loss=calculate_per_token_loss, num_tokens=num_tokens)
    no_sync = getattr(model, "no_sync", None)
    no_sync_ctx = no_sync if (callable(no_sync) and not forward_only) else contextlib.nullcontext
    store: list = []
    with no_sync_ctx():
        for _ in range(num_microbatches - 1):
            out = _forward_step(forward_step_func, data_iterator, model, num_microbatches, store,
                                collect_non_loss_data, **per_token)
            if not forward_only and out is not None:
                _backward_step(out, grad_scale_func)
    out = _forward_step(forward_step_func, data_iterator, model, num_microbatches, store, collect_non_loss_data,
                        **per_token)
    if not forward_only and out is not None:
        _backward_step(out, grad_scale_func)
    return store


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None) -> Callable[..., list]:
    """The schedule for this layout: no pipelining, 1F1B, or interleaved 1F1B with virtual stages."""
    if pipeline_model_parallel_size > 1:
        if virtual_pipeline_model_parallel_size is not None:
            return pipelined.forward_backward_pipelining_with_interleaving
        return pipelined.forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining
