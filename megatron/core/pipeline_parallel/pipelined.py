"""Pipelined micro-batch schedules (Megatron-LM's algorithms, written for this project).

* ``forward_backward_pipelining_without_interleaving`` — 1F1B: stage ``r`` of ``p`` runs ``p - r - 1`` warm-up
  forwards, then alternates one forward / one backward, then drains the remaining backwards; at most ``p - r``
  micro-batches are in flight per stage (the activation-memory bound).
* ``forward_backward_pipelining_with_interleaving`` — interleaved 1F1B: ``model`` is the list of this rank's
  virtual-stage chunks; micro-batches go through the chunks in groups of ``p``.

Both take Megatron's keyword arguments (``forward_step_func``, ``data_iterator``, ``model``, ``num_microbatches``,
``seq_length``, ``micro_batch_size``, ``forward_only``, ``collect_non_loss_data``) plus ``grad_scale_func`` (the
optimizer's loss scaling), ``parallel_state`` (default: the global one) and ``p2p`` (a communicator with
``communicate(send_next, send_prev, recv_prev, recv_next)``; default: a ``P2PCommunicator``; tests pass a fake one).
The loss dicts are returned on the last stage only; other stages return an empty list. Encoder-and-decoder models
pipelined with a split rank (T5) send lists of tensors with per-stage shapes (``get_tensor_shapes``; 1F1B only).
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron.core import aux_losses
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, TorchDistributedDataParallel
from megatron.core.pipeline_parallel.losses import aux_loss_divisor, micro_batch_loss
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.utils import flatten_dense_tensors, unflatten_dense_tensors
from megatron.core.utils import unwrap_model as _unwrap


def _chunks(model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def tensor_shape_for(model: torch.nn.Module, seq_length: int, micro_batch_size: int) -> tuple[int, int, int]:
    """[seq (/cp with context parallelism, /tp with sequence parallelism), micro batch, hidden] of the activations
    passed between stages."""
    config = _unwrap(model).config
    seq = seq_length // int(getattr(config, "context_parallel_size", 1) or 1)
    if getattr(config, "sequence_parallel", False):
        seq = seq // int(getattr(config, "tensor_model_parallel_size", 1))
    return (seq, micro_batch_size, config.hidden_size)


def get_tensor_shapes(rank: int, state: Any, model: torch.nn.Module, seq_length: int,
                      decoder_seq_length: Optional[int], micro_batch_size: int) -> list:
    """Megatron's get_tensor_shapes: the shapes of the message that stage ``rank`` sends forward. One
    [seq(/tp), mb, h] tensor, or with an encoder-and-decoder split rank: [enc_seq(/tp), mb, h] from an encoder
    stage, [[dec_seq(/tp), mb, h], [enc_seq(/tp), mb, h]] (decoder hidden states, encoder output) from a decoder
    stage."""
    enc = tensor_shape_for(model, seq_length, micro_batch_size)
    if getattr(state, "pipeline_split_rank", None) is None or state.is_pipeline_stage_before_split(rank):
        return [enc]
    if decoder_seq_length is None:
        raise ValueError("an encoder-and-decoder pipeline needs decoder_seq_length (--decoder-seq-length)")
    return [tensor_shape_for(model, decoder_seq_length, micro_batch_size), enc]


class _ListMessages:
    """``communicate`` of the single-tensor schedule on messages that are lists of tensors: this stage receives
    ``recv_shapes`` from the previous stage (and their grads go back), sends ``send_shapes`` to the next."""

    def __init__(self, p2p: Any, recv_shapes: list, send_shapes: list) -> None:
        self.p2p, self.recv_shapes, self.send_shapes = p2p, recv_shapes, send_shapes

    def communicate(self, send_next: Any = None, send_prev: Optional[list] = None, recv_prev: bool = False,
                    recv_next: bool = False) -> tuple[Optional[list], Optional[list]]:
        if send_next is not None and not isinstance(send_next, (list, tuple)):
            send_next = [send_next]
        return self.p2p.communicate_many(send_next=send_next, send_prev=send_prev,
                                         recv_prev_shapes=self.recv_shapes if recv_prev else None,
                                         recv_next_shapes=self.send_shapes if recv_next else None)


def _default_p2p(model: torch.nn.Module, state: Any, seq_length: Optional[int], micro_batch_size: Optional[int]):
    if seq_length is None or micro_batch_size is None:
        raise ValueError("pipelined schedules need seq_length and micro_batch_size (the activation shape)")
    config = _unwrap(model).config
    dtype = torch.float32 if getattr(config, "fp32_residual_connection", False) else config.params_dtype
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    return P2PCommunicator(state, tensor_shape_for(model, seq_length, micro_batch_size), dtype, device)


def _state_or_global(parallel_state: Any) -> Any:
    if parallel_state is not None:
        return parallel_state
    return ps.get_parallel_state()


class _Stepper:
    """Forward and backward of one micro-batch on one model chunk, shared by both schedules."""

    def __init__(self, forward_step_func: Callable, num_microbatches: int, forward_only: bool,
                 collect_non_loss_data: bool, grad_scale_func: Optional[Callable], chunks: list,
                 per_token: Optional[dict] = None) -> None:
        self.forward_step_func = forward_step_func
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.grad_scale_func = grad_scale_func
        self.per_token = per_token or {}  # --calculate-per-token-loss: {calculate_per_token_loss, num_tokens}
        aux_losses.set_scale_for_schedule(
            aux_loss_divisor(num_microbatches, self.per_token.get("calculate_per_token_loss", False)), grad_scale_func)
        self.store: list = []
        self.chunks = chunks
        # torch DDP decides at forward time whether the backward all-reduces; under 1F1B the forwards of later
        # micro-batches run before earlier backwards, so keep every chunk in no_sync() and reduce once at the end.
        self.no_sync = contextlib.ExitStack()
        if not forward_only:
            for chunk in chunks:
                if isinstance(chunk, TorchDistributedDataParallel):
                    self.no_sync.enter_context(chunk.no_sync())
        # The local DDP (--overlap-grad-reduce) starts a bucket's reduction when its grads of the last micro-batch
        # arrive: every other backward of a chunk runs under its no_sync().
        self.backwards_done = [0] * len(chunks)

    def forward(self, data_iterator: Optional[Iterator], chunk_id: int, input_tensor: Optional[torch.Tensor],
                is_last_stage: bool) -> Optional[torch.Tensor]:
        model = self.chunks[chunk_id]
        _unwrap(model).set_input_tensor(input_tensor)
        output_tensor, loss_func = self.forward_step_func(data_iterator, model)
        if not is_last_stage:
            return output_tensor
        if self.collect_non_loss_data:
            self.store.append(loss_func(output_tensor, non_loss_data=True))
            return output_tensor
        loss, loss_reduced = micro_batch_loss(loss_func(output_tensor), self.num_microbatches,
                                              self.per_token.get("calculate_per_token_loss", False),
                                              self.per_token.get("num_tokens"))
        self.store.append(loss_reduced)
        return loss

    def backward_many(self, chunk_id: int, input_tensors: Optional[list], output_tensors: Any,
                      output_grads: Optional[list]) -> Optional[list]:
        """Backward of a stage whose messages are lists of tensors. An output that is one of the inputs, passed on
        unchanged (T5's encoder output on decoder stages), is not differentiated: its received grad is added to that
        input's grad, which then flows back to the encoder stages."""
        inputs = list(input_tensors or [])
        for x in inputs:
            if x is not None:
                x.retain_grad()
        outputs = list(output_tensors) if isinstance(output_tensors, (list, tuple)) else [output_tensors]
        grads = list(output_grads) if output_grads is not None else [None] * len(outputs)
        through, tensors, tensor_grads = [], [], []
        for out, grad in zip(outputs, grads):
            index = next((i for i, x in enumerate(inputs) if x is out), None)
            if index is not None:
                if grad is not None:
                    through.append((index, grad))
            else:
                tensors.append(out)
                tensor_grads.append(grad)
        if tensor_grads[0] is None and self.grad_scale_func is not None:
            tensors[0] = self.grad_scale_func(tensors[0])
        chunk = self.chunks[chunk_id]
        self.backwards_done[chunk_id] += 1
        last_microbatch = self.backwards_done[chunk_id] == self.num_microbatches
        sync = chunk.no_sync() if isinstance(chunk, DistributedDataParallel) and not last_microbatch \
            else contextlib.nullcontext()
        with sync:
            torch.autograd.backward(tensors, grad_tensors=tensor_grads)
        if not inputs:
            return None
        result = [x.grad if x is not None else None for x in inputs]
        for index, grad in through:
            result[index] = grad if result[index] is None else result[index] + grad
        return result

    def backward(self, chunk_id: int, input_tensor: Optional[torch.Tensor], output_tensor: torch.Tensor,
                 output_tensor_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if input_tensor is not None:
            input_tensor.retain_grad()
        if output_tensor_grad is None and self.grad_scale_func is not None:
            output_tensor = self.grad_scale_func(output_tensor)
        chunk = self.chunks[chunk_id]
        self.backwards_done[chunk_id] += 1
        last_microbatch = self.backwards_done[chunk_id] == self.num_microbatches
        sync = chunk.no_sync() if isinstance(chunk, DistributedDataParallel) and not last_microbatch \
            else contextlib.nullcontext()
        with sync:
            torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
        return input_tensor.grad if input_tensor is not None else None

    def close(self) -> None:
        self.no_sync.close()

    def finish(self) -> None:
        """After the last backward: average the grads of torch-DDP chunks over their data-parallel group."""
        if self.forward_only:
            return
        for chunk in self.chunks:
            if isinstance(chunk, TorchDistributedDataParallel):
                _allreduce_mean_grads(chunk)


def _allreduce_mean_grads(chunk: torch.nn.Module) -> None:
    group = chunk.dp_group
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in chunk.parameters() if p.grad is not None]
    if not grads:
        return
    flat = flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for grad, synced in zip(grads, unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def forward_backward_pipelining_without_interleaving(
    forward_step_func: Callable,
    data_iterator: Optional[Iterator],
    model: Union[torch.nn.Module, list],
    num_microbatches: int,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    grad_scale_func: Optional[Callable] = None,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    parallel_state: Any = None,
    p2p: Any = None,
    decoder_seq_length: Optional[int] = None,
    calculate_per_token_loss: bool = False,
    num_tokens: Optional[torch.Tensor] = None,
    **unused: Any,
) -> list:
    """1F1B over the pipeline stages (one model chunk per rank).

    With an encoder-and-decoder split rank in ``parallel_state`` (T5) every message is a list of tensors with
    per-stage shapes (``get_tensor_shapes``; ``decoder_seq_length`` gives the decoder's)."""
    # port of Megatron's forward_backward_pipelining_without_interleaving (1F1B schedule)
    chunks = _chunks(model)
    if len(chunks) != 1:
        raise ValueError("the 1F1B schedule takes one model chunk per rank; use the interleaved schedule for "
                         "virtual pipeline stages")
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = data_iterator[0]
    state = _state_or_global(parallel_state)
    p2p = p2p or _default_p2p(chunks[0], state, seq_length, micro_batch_size)
    first, last = state.is_pipeline_first_stage(), state.is_pipeline_last_stage()
    step = _Stepper(forward_step_func, num_microbatches, forward_only, collect_non_loss_data, grad_scale_func, chunks,
                    dict(calculate_per_token_loss=calculate_per_token_loss, num_tokens=num_tokens))
    many = getattr(state, "pipeline_split_rank", None) is not None
    if many:
        p2p = _ListMessages(p2p, get_tensor_shapes(state.pp_rank - 1, state, chunks[0], seq_length,
                                                   decoder_seq_length, micro_batch_size),
                            get_tensor_shapes(state.pp_rank, state, chunks[0], seq_length, decoder_seq_length,
                                              micro_batch_size))
        step.backward = step.backward_many  # type: ignore[method-assign]

    def recv_forward() -> Optional[torch.Tensor]:
        return None if first else p2p.communicate(recv_prev=True)[0]

    def send_forward(out: torch.Tensor) -> None:
        if not last:
            p2p.communicate(send_next=out)

    num_warmup = num_microbatches if forward_only else min(state.pp_size - state.pp_rank - 1, num_microbatches)
    num_remaining = num_microbatches - num_warmup
    inputs: list = []
    outputs: list = []
    try:
        for _ in range(num_warmup):
            input_tensor = recv_forward()
            output_tensor = step.forward(data_iterator, 0, input_tensor, last)
            send_forward(output_tensor)
            if not forward_only:
                inputs.append(input_tensor)
                outputs.append(output_tensor)

        input_tensor = recv_forward() if num_remaining > 0 else None
        for i in range(num_remaining):
            last_iteration = i == num_remaining - 1
            output_tensor = step.forward(data_iterator, 0, input_tensor, last)
            if forward_only:
                send_forward(output_tensor)
                if not last_iteration:
                    input_tensor = recv_forward()
                continue
            output_grad = None if last else p2p.communicate(send_next=output_tensor, recv_next=True)[1]
            inputs.append(input_tensor)
            outputs.append(output_tensor)
            input_grad = step.backward(0, inputs.pop(0), outputs.pop(0), output_grad)
            if last_iteration:
                if not first:
                    p2p.communicate(send_prev=input_grad)
            else:
                input_tensor = None if first else p2p.communicate(send_prev=input_grad, recv_prev=True)[0]

        if not forward_only:
            for _ in range(num_warmup):
                output_grad = None if last else p2p.communicate(recv_next=True)[1]
                input_grad = step.backward(0, inputs.pop(0), outputs.pop(0), output_grad)
                if not first:
                    p2p.communicate(send_prev=input_grad)
    finally:
        step.close()
    step.finish()
    return step.store if last else []


def forward_backward_pipelining_with_interleaving(
    forward_step_func: Callable,
    data_iterator: Union[Optional[Iterator], list],
    model: list,
    num_microbatches: int,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    grad_scale_func: Optional[Callable] = None,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    parallel_state: Any = None,
    p2p: Any = None,
    calculate_per_token_loss: bool = False,
    num_tokens: Optional[torch.Tensor] = None,
    **unused: Any,
) -> list:
    """Interleaved 1F1B: ``model`` holds this rank's virtual-stage chunks (chunk c = virtual stage c)."""
    # port of Megatron's forward_backward_pipelining_with_interleaving (interleaved 1F1B schedule)
    chunks = _chunks(model)
    num_chunks = len(chunks)
    state = _state_or_global(parallel_state)
    if getattr(state, "pipeline_split_rank", None) is not None:
        raise ValueError("interleaved pipeline stages are not supported for encoder-and-decoder models (T5 with "
                         "--pipeline-model-parallel-split-rank): drop --num-layers-per-virtual-pipeline-stage")
    pp_size, pp_rank = state.pp_size, state.pp_rank
    if num_microbatches % pp_size != 0:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) to be "
                         f"divisible by --pipeline-model-parallel-size ({pp_size})")
    if isinstance(data_iterator, (list, tuple)):
        iterators = list(data_iterator)
    elif data_iterator is None:
        iterators = [None] * num_chunks
    else:  # every chunk reads the same micro-batches in the same order
        iterators = list(itertools.tee(data_iterator, num_chunks))
    p2p = p2p or _default_p2p(chunks[0], state, seq_length, micro_batch_size)
    step = _Stepper(forward_step_func, num_microbatches, forward_only, collect_non_loss_data, grad_scale_func, chunks,
                    dict(calculate_per_token_loss=calculate_per_token_loss, num_tokens=num_tokens))
    first_rank, last_rank = state.is_pipeline_first_stage(True), state.is_pipeline_last_stage(True)
    is_first_chunk = [first_rank and c == 0 for c in range(num_chunks)]
    is_last_chunk = [last_rank and c == num_chunks - 1 for c in range(num_chunks)]

    total = num_microbatches * num_chunks
    all_warmup = False
    if forward_only:
        num_warmup = total
    elif num_microbatches == pp_size:
        num_warmup, all_warmup = total, True
    else:
        num_warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)
    num_remaining = total - num_warmup

    def chunk_id(k: int, forward: bool) -> int:
        c = (k % (pp_size * num_chunks)) // pp_size
        return c if forward else num_chunks - c - 1

    inputs: list = [[] for _ in range(num_chunks)]
    outputs: list = [[] for _ in range(num_chunks)]
    out_grads: list = [[] for _ in range(num_chunks)]

    def forward_helper(k: int) -> Optional[torch.Tensor]:
        c = chunk_id(k, True)
        state.set_virtual_pipeline_model_parallel_rank(c)
        if is_first_chunk[c] and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)
        out = step.forward(iterators[c], c, inputs[c][-1], is_last_chunk[c])
        outputs[c].append(out)
        if forward_only:
            inputs[c].pop()
            outputs[c].pop()
        return out

    def backward_helper(k: int) -> Optional[torch.Tensor]:
        c = chunk_id(k, False)
        state.set_virtual_pipeline_model_parallel_rank(c)
        if is_last_chunk[c] and not out_grads[c]:
            out_grads[c].append(None)
        return step.backward(c, inputs[c].pop(0), outputs[c].pop(0), out_grads[c].pop(0))

    try:
        inputs[0].append(None if first_rank else p2p.communicate(recv_prev=True)[0])
        for k in range(num_warmup):
            out = forward_helper(k)
            next_c = chunk_id(k + 1, True)
            recv_prev = not (first_rank and next_c == 0) and k != total - 1
            if is_last_chunk[chunk_id(k, True)]:
                out = None
            if k == num_warmup - 1 and not forward_only and not all_warmup:
                recv_next = not last_rank
                in_t, grad_t = p2p.communicate(send_next=out, recv_prev=recv_prev, recv_next=recv_next)
                out_grads[num_chunks - 1].append(grad_t)
            else:
                in_t = p2p.communicate(send_next=out, recv_prev=recv_prev)[0]
            inputs[next_c].append(in_t)

        for k in range(num_remaining):
            fk, bk = k + num_warmup, k
            out = forward_helper(fk)
            in_grad = backward_helper(bk)
            if is_last_chunk[chunk_id(fk, True)]:
                out = None
            if is_first_chunk[chunk_id(bk, False)]:
                in_grad = None
            recv_prev = True
            if first_rank:
                next_fc = chunk_id(fk - (pp_size - 1), True)
                if next_fc == num_chunks - 1:
                    recv_prev = False
                next_fc += 1
            else:
                next_fc = chunk_id(fk + 1, True)
            recv_next = True
            if last_rank:
                next_bc = chunk_id(bk - (pp_size - 1), False)
                if next_bc == 0:
                    recv_next = False
                next_bc -= 1
            else:
                next_bc = chunk_id(bk + 1, False)
            if k == num_remaining - 1:
                recv_prev = False
            in_t, grad_t = p2p.communicate(send_next=out, send_prev=in_grad, recv_prev=recv_prev,
                                           recv_next=recv_next)
            if recv_prev:
                inputs[next_fc].append(in_t)
            if recv_next:
                out_grads[next_bc].append(grad_t)

        if not forward_only:
            if all_warmup:
                out_grads[num_chunks - 1].append(None if last_rank else p2p.communicate(recv_next=True)[1])
            for k in range(num_remaining, total):
                in_grad = backward_helper(k)
                next_bc = chunk_id(k + 1, False)
                recv_next = not (last_rank and next_bc == num_chunks - 1) and k != total - 1
                if is_first_chunk[chunk_id(k, False)]:
                    in_grad = None
                grad_t = p2p.communicate(send_prev=in_grad, recv_next=recv_next)[1]
                out_grads[next_bc].append(grad_t)
    finally:
        step.close()
        state.set_virtual_pipeline_model_parallel_rank(0)
    step.finish()
    return step.store if last_rank else []
