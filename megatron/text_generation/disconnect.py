"""Cancel on disconnect for the REST server: is a client gone (`client_gone`), and the per-step decision that every
rank of the job takes together (`StopCheck`, a `should_stop` for megatron/text_generation/generation.py).

Rank 0 owns the HTTP connections; the other ranks only run the generation. So rank 0 tests its client after every
decoding step and broadcasts the answer over the server's process group: every rank leaves the decoding loop at the
same step and the collectives stay in lockstep.
"""
from __future__ import annotations

import select
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist


def client_gone(connection: Any) -> bool:
    """Whether the peer has closed or reset the connected socket `connection` (never blocks).

    A readable socket whose peek reads no bytes is at end of file; bytes waiting (a pipelined next request) are not
    a disconnect. A client that half-closes its side while waiting for the answer counts as gone.
    """
    if connection is None:
        return False
    try:
        poller = select.poll()  # not select.select: it cannot take descriptors >= 1024
        poller.register(connection, select.POLLIN)
        if not poller.poll(0):
            return False
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, TimeoutError):
        return False
    except (OSError, ValueError):  # reset by the peer, or closed here
        return True


class StopCheck:
    """`should_stop` for one request, called by every rank after each decoding step: rank 0 asks `gone()`, and its
    answer is broadcast over `group` so every rank stops at the same step. `cancelled` and `steps` tell what happened.
    """

    def __init__(self, gone: Callable[[], bool], group: Any, src_rank: int, distributed: bool) -> None:
        self.gone, self.group, self.src_rank, self.distributed = gone, group, src_rank, distributed
        self.cancelled, self.steps = False, 0

    def __call__(self) -> bool:
        self.steps += 1
        flag = bool(self.gone())
        if self.distributed:
            nccl = dist.get_backend(self.group) == "nccl"
            box = torch.tensor([int(flag)], device=torch.device("cuda", torch.cuda.current_device()) if nccl
                               else "cpu")
            dist.broadcast(box, src=self.src_rank, group=self.group)
            flag = bool(box.item())
        self.cancelled = self.cancelled or flag
        return flag
