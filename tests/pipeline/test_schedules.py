"""The pipelined schedules against a fake P2P layer (one process, each stage run on its own): order of forward and
backward steps per stage, 1F1B's activation-memory bound (at most PP - stage micro-batches in flight), matching
sends/receives between neighbouring stages, virtual-chunk order of the interleaved schedule, forward-only mode."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.pipelined import (
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)

SHAPE = (2, 3)


class FakeP2P:
    """Records the P2P operations; receives return fresh tensors (activations require grad)."""

    def __init__(self) -> None:
        self.ops: Counter = Counter()

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        for name, flag in (("send_next", send_next is not None), ("send_prev", send_prev is not None),
                           ("recv_prev", recv_prev), ("recv_next", recv_next)):
            self.ops[name] += int(bool(flag))
        return (torch.randn(SHAPE, requires_grad=True) if recv_prev else None,
                torch.ones(SHAPE) if recv_next else None)


class Chunk(torch.nn.Module):
    def __init__(self, chunk_id: int, events: list) -> None:
        super().__init__()
        self.chunk_id, self.events = chunk_id, events
        self.lin = torch.nn.Linear(SHAPE[1], SHAPE[1])
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, mb: int) -> torch.Tensor:
        x = self.input_tensor if self.input_tensor is not None else torch.full(SHAPE, float(mb))
        out = self.lin(x)
        out.register_hook(lambda g: self.events.append(("B", self.chunk_id, mb)))
        return out


def _forward_step(events: list):
    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        events.append(("F", model.chunk_id, mb))
        out = model(mb)
        return out, lambda o: (o.sum(), {"loss": float(mb)})
    return forward_step


def _run_stage(pp_size: int, rank: int, num_mb: int, num_chunks: int = 1, forward_only: bool = False):
    state = ParallelState(pp_rank=rank, pp_size=pp_size, pp_ranks=list(range(pp_size)),
                          virtual_pp_rank=0 if num_chunks > 1 else None,
                          virtual_pp_size=num_chunks if num_chunks > 1 else None)
    events: list = []
    chunks = [Chunk(c, events) for c in range(num_chunks)]
    p2p = FakeP2P()
    schedule = (forward_backward_pipelining_with_interleaving if num_chunks > 1
                else forward_backward_pipelining_without_interleaving)
    store = schedule(forward_step_func=_forward_step(events), data_iterator=iter(range(num_mb)), model=chunks,
                     num_microbatches=num_mb, forward_only=forward_only, parallel_state=state, p2p=p2p)
    return events, p2p.ops, store


@pytest.mark.parametrize("pp_size,num_mb", [(4, 8), (4, 2), (2, 5)])
def test_1f1b_order_and_memory_bound(pp_size: int, num_mb: int) -> None:
    ops = []
    for rank in range(pp_size):
        events, p2p_ops, store = _run_stage(pp_size, rank, num_mb)
        kinds = [e[0] for e in events]
        warmup = min(pp_size - rank - 1, num_mb)
        assert kinds == ["F"] * warmup + ["F", "B"] * (num_mb - warmup) + ["B"] * warmup, (rank, kinds)
        assert [e[2] for e in events if e[0] == "F"] == list(range(num_mb))
        assert [e[2] for e in events if e[0] == "B"] == list(range(num_mb))
        in_flight, peak = 0, 0
        for kind in kinds:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak <= pp_size - rank and peak == min(pp_size - rank, num_mb)
        assert len(store) == (num_mb if rank == pp_size - 1 else 0)
        ops.append(p2p_ops)
    assert ops[0]["recv_prev"] == ops[0]["send_prev"] == 0
    assert ops[-1]["send_next"] == ops[-1]["recv_next"] == 0
    for rank in range(pp_size - 1):  # every activation sent is received, every gradient sent back is received
        assert ops[rank]["send_next"] == ops[rank + 1]["recv_prev"] == num_mb
        assert ops[rank + 1]["send_prev"] == ops[rank]["recv_next"] == num_mb


@pytest.mark.parametrize("num_mb", [8, 4])
def test_interleaved_order_and_matching(num_mb: int) -> None:
    pp_size, chunks = 4, 2
    ops = []
    for rank in range(pp_size):
        events, p2p_ops, store = _run_stage(pp_size, rank, num_mb, num_chunks=chunks)
        fwd = [(c, mb) for kind, c, mb in events if kind == "F"]
        bwd = [(c, mb) for kind, c, mb in events if kind == "B"]
        # forwards go through the chunks in groups of pp_size micro-batches; backwards in reverse chunk order
        expect_f = [(k % (pp_size * chunks)) // pp_size for k in range(num_mb * chunks)]
        assert [c for c, _ in fwd] == expect_f
        assert [c for c, _ in bwd] == [chunks - 1 - c for c in expect_f]
        for c in range(chunks):
            assert [mb for cc, mb in fwd if cc == c] == list(range(num_mb))
            assert [mb for cc, mb in bwd if cc == c] == list(range(num_mb))
        assert len(store) == (num_mb if rank == pp_size - 1 else 0)
        ops.append(p2p_ops)
    for rank in range(pp_size):  # with wrap-around: last stage chunk c feeds first stage chunk c + 1
        nxt = (rank + 1) % pp_size
        assert ops[rank]["send_next"] == ops[nxt]["recv_prev"]
        assert ops[nxt]["send_prev"] == ops[rank]["recv_next"]
    assert ops[0]["recv_prev"] == num_mb * (chunks - 1)


@pytest.mark.parametrize("num_chunks", [1, 2])
def test_forward_only(num_chunks: int) -> None:
    for rank in range(4):
        events, _, store = _run_stage(4, rank, 4, num_chunks=num_chunks, forward_only=True)
        assert [e[0] for e in events] == ["F"] * 4 * num_chunks
        assert len(store) == (4 if rank == 3 else 0)


def test_schedule_selection_and_interleaving_rule() -> None:
    assert get_forward_backward_func(2) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(4, 2) is forward_backward_pipelining_with_interleaving
    with pytest.raises(ValueError, match="divisible by --pipeline-model-parallel-size"):
        _run_stage(4, 0, 6, num_chunks=2)
