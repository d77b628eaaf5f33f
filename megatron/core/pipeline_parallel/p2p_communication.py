"""Point-to-point communication of activations and gradients between neighbouring pipeline stages.

Every exchange is posted as one ``torch.distributed.batch_isend_irecv`` (works with gloo and NCCL). Shapes are known
ahead of time (``[seq (/tp under sequence parallelism), micro batch, hidden]``), so no shape exchange is needed.
Activations travel with tag 0, gradients with tag 1. ``communicate_many`` sends messages of several
tensors with per-tensor shapes (encoder-and-decoder pipelines: Megatron's per-stage lists of tensor shapes). Set ``MEGATRON_DEBUG_P2P=1`` to print every P2P operation
(rank, op, peer, shape) to stderr.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

ACT_TAG = 0
GRAD_TAG = 1


def debug_p2p_enabled() -> bool:
    """True when MEGATRON_DEBUG_P2P is set to a non-empty value other than 0."""
    return os.environ.get("MEGATRON_DEBUG_P2P", "0") not in ("", "0")


class P2PCommunicator:
    """Send/receive between this rank's previous and next pipeline stage (wrapping around for virtual stages).

    ``parallel_state`` provides ``pp_prev_rank()``, ``pp_next_rank()``, ``is_pipeline_first_stage()`` and
    ``is_pipeline_last_stage()`` (global ranks). Receiving returns fresh tensors that require grad, so the
    backward pass of the receiving stage produces the gradient to send back.
    """

    def __init__(self, parallel_state: Any, tensor_shape: Sequence[int], dtype: torch.dtype,
                 device: Optional[torch.device] = None, debug: Optional[bool] = None) -> None:
        self.state = parallel_state
        self.tensor_shape = tuple(int(x) for x in tensor_shape)
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self.debug = debug_p2p_enabled() if debug is None else debug

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device, requires_grad=True)

    def _log(self, op: str, peer: int, tensor: torch.Tensor) -> None:
        if self.debug:
            print(f"[p2p] rank {self.state.global_rank} (pp {self.state.pp_rank}): {op} peer {peer} "
                  f"shape {tuple(tensor.shape)} {tensor.dtype}", file=sys.stderr, flush=True)

    def communicate(self, send_next: Optional[torch.Tensor] = None, send_prev: Optional[torch.Tensor] = None,
                    recv_prev: bool = False, recv_next: bool = False
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Post all requested sends/receives as one batch and wait; returns (from_prev, from_next)."""
        prev_rank, next_rank = self.state.pp_prev_rank(), self.state.pp_next_rank()
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        ops = []
        # Activations flow forward (tag ACT), gradients backward (tag GRAD): each directed pair carries at most
        # one message per tag per call, so the order of posting does not matter for matching.
        if send_next is not None:
            self._check(send_next, "send_next")
            ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), next_rank, tag=ACT_TAG))
            self._log("send_forward", next_rank, send_next)
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev.data, prev_rank, tag=ACT_TAG))
            self._log("recv_forward", prev_rank, from_prev)
        if send_prev is not None:
            self._check(send_prev, "send_prev")
            ops.append(dist.P2POp(dist.isend, send_prev.detach().contiguous(), prev_rank, tag=GRAD_TAG))
            self._log("send_backward", prev_rank, send_prev)
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next.data, next_rank, tag=GRAD_TAG))
            self._log("recv_backward", next_rank, from_next)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return from_prev, from_next

    def communicate_many(
        self,
        send_next: Optional[Sequence[torch.Tensor]] = None,
        send_prev: Optional[Sequence[torch.Tensor]] = None,
        recv_prev_shapes: Optional[Sequence[Sequence[int]]] = None,
        recv_next_shapes: Optional[Sequence[Sequence[int]]] = None,
    ) -> tuple[Optional[list], Optional[list]]:
        """Messages of several tensors with their own shapes (T5's decoder stages pass [decoder hidden states,
        encoder output]), all posted as one batch; tensor i of a message travels with tag ACT/GRAD + 2 i.
        Returns (list from prev or None, list from next or None)."""
        prev_rank, next_rank = self.state.pp_prev_rank(), self.state.pp_next_rank()

        def empty(shape: Sequence[int]) -> torch.Tensor:
            return torch.empty(tuple(int(x) for x in shape), dtype=self.dtype, device=self.device,
                               requires_grad=True)

        from_prev = [empty(shape) for shape in recv_prev_shapes] if recv_prev_shapes is not None else None
        from_next = [empty(shape) for shape in recv_next_shapes] if recv_next_shapes is not None else None
        ops = []
        for i, tensor in enumerate(send_next or []):
            ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), next_rank, tag=ACT_TAG + 2 * i))
            self._log(f"send_forward[{i}]", next_rank, tensor)
        for i, tensor in enumerate(from_prev or []):
            ops.append(dist.P2POp(dist.irecv, tensor.data, prev_rank, tag=ACT_TAG + 2 * i))
            self._log(f"recv_forward[{i}]", prev_rank, tensor)
        for i, tensor in enumerate(send_prev or []):
            ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), prev_rank, tag=GRAD_TAG + 2 * i))
            self._log(f"send_backward[{i}]", prev_rank, tensor)
        for i, tensor in enumerate(from_next or []):
            ops.append(dist.P2POp(dist.irecv, tensor.data, next_rank, tag=GRAD_TAG + 2 * i))
            self._log(f"recv_backward[{i}]", next_rank, tensor)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return from_prev, from_next

    def _check(self, tensor: torch.Tensor, what: str) -> None:
        if tuple(tensor.shape) != self.tensor_shape:
            raise RuntimeError(f"pipeline {what}: tensor shape {tuple(tensor.shape)} differs from the expected "
                               f"{self.tensor_shape} ([seq(/tp with --sequence-parallel), micro batch, hidden])")

    # ---- Megatron's helper names (no-ops on the first/last stage where there is no neighbour) --------------
    def recv_forward(self) -> Optional[torch.Tensor]:
        if self.state.is_pipeline_first_stage():
            return None
        return self.communicate(recv_prev=True)[0]

    def recv_backward(self) -> Optional[torch.Tensor]:
        if self.state.is_pipeline_last_stage():
            return None
        return self.communicate(recv_next=True)[1]

    def send_forward(self, output_tensor: Optional[torch.Tensor]) -> None:
        if not self.state.is_pipeline_last_stage():
            self.communicate(send_next=output_tensor)

    def send_backward(self, input_tensor_grad: Optional[torch.Tensor]) -> None:
        if not self.state.is_pipeline_first_stage():
            self.communicate(send_prev=input_tensor_grad)

    def send_forward_recv_backward(self, output_tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.state.is_pipeline_last_stage():
            return None
        return self.communicate(send_next=output_tensor, recv_next=True)[1]

    def send_backward_recv_forward(self, input_tensor_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.state.is_pipeline_first_stage():
            return None
        return self.communicate(send_prev=input_tensor_grad, recv_prev=True)[0]
