"""RNG tracker semantics, Megatron's TP seeding, and activation recomputation that replays dropout exactly."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from tests.dist_utils import run_distributed


def test_fork_uses_its_own_stream_and_leaves_default_untouched():
    tracker = tp.RNGStatesTracker()
    tracker.add("a", 5)
    torch.manual_seed(0)
    expected_default = torch.rand(4)
    torch.manual_seed(0)
    with tracker.fork("a"):
        first = torch.rand(4)
    with tracker.fork("a"):
        second = torch.rand(4)
    assert torch.equal(torch.rand(4), expected_default)  # the default generator did not move
    assert not torch.equal(first, second)  # the stream advanced between forks
    torch.manual_seed(5)
    assert torch.equal(torch.rand(4), first)  # the stream is the generator seeded with its seed
    states = tracker.get_states()
    with tracker.fork("a"):
        third = torch.rand(4)
    tracker.set_states(states)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), third)  # get/set_states round-trips
    tracker.set_states({"a": torch.get_rng_state(), "gpu": torch.zeros(16, dtype=torch.uint8)})  # Megatron-style
    assert tracker.states_["a"]["cuda"] is None and tracker.states_["gpu"]["cpu"] is None
    with tracker.fork("gpu"):  # a CUDA-only stream on a CPU machine: draws from the default CPU generator
        torch.rand(1)
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("a", 6)
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("b", 5)
    with pytest.raises(RuntimeError, match="model_parallel_manual_seed"), tracker.fork("missing"):
        pass


def test_model_parallel_manual_seed_registers_stream():
    tp.model_parallel_manual_seed(1234, tp_rank=1)
    tracker = tp.get_rng_tracker()
    assert set(tracker.get_states()) == {"model-parallel-rng"}
    with tracker.fork():
        inside = torch.rand(3)
    torch.manual_seed(1234 + 2718 + 1)
    assert torch.equal(inside, torch.rand(3))
    tp.model_parallel_manual_seed(1234, tp_rank=0)  # the default generator gets the plain seed
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(1234)))


class _Block(torch.nn.Module):
    """Linear → dropout (default stream) → linear → dropout inside the model-parallel stream."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 12)
        self.b = torch.nn.Linear(12, 6)

    def forward(self, x, scale=1.0):
        y = F.dropout(torch.tanh(self.a(x)), 0.5, training=True)
        with tp.get_rng_tracker().fork():
            y = F.dropout(self.b(y), 0.3, training=True)
        return y * scale, y.sum()


def _grads(recompute, x_requires_grad, distribute=False, group=None):
    torch.manual_seed(0)
    block = _Block()
    tp.model_parallel_manual_seed(42, tp_rank=0)
    x = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(1)).requires_grad_(x_requires_grad)
    if recompute:
        out, total = tp.checkpoint(block, distribute, x, 2.0, tp_group=group)
    else:
        out, total = block(x, 2.0)
    ((out ** 2).sum() + total).backward()
    after = torch.rand(2)  # the RNG stream continues as if no recomputation happened
    return [p.grad.clone() for p in block.parameters()], (x.grad if x_requires_grad else None), out.detach(), after


@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_checkpoint_recompute_matches_no_recompute_with_dropout(x_requires_grad):
    ref_p, ref_x, ref_out, ref_after = _grads(False, x_requires_grad)
    got_p, got_x, got_out, got_after = _grads(True, x_requires_grad)
    assert torch.equal(got_out, ref_out)
    assert (ref_out == 0).any()  # dropout really dropped something
    for a, b in zip(got_p, ref_p):
        assert torch.allclose(a, b, atol=1e-6) and a.abs().sum() > 0
    if x_requires_grad:
        assert torch.allclose(got_x, ref_x, atol=1e-6)
    assert torch.equal(got_after, ref_after)


def test_checkpoint_params_get_grads_when_no_input_requires_grad():
    # Inputs that don't require grad: parameter gradients still flow (the dummy input keeps the graph alive).
    got_p, _, _, _ = _grads(True, False)
    assert all(g.abs().sum() > 0 for g in got_p)


def _tp_rng_body(rank, world):
    state = ps.initialize_model_parallel(world, 1)
    tp.model_parallel_manual_seed(1234 + 100 * state.pp_rank)
    ones = torch.ones(64)
    outside = F.dropout(ones, 0.5, training=True)
    with tp.get_rng_tracker().fork():
        inside = F.dropout(ones, 0.5, training=True)
    gathered = [torch.zeros(64) for _ in range(world)]
    dist.all_gather(gathered, outside, group=state.tp_group)
    same_outside = all(torch.equal(g, gathered[0]) for g in gathered)
    dist.all_gather(gathered, inside, group=state.tp_group)
    same_inside = all(torch.equal(g, gathered[0]) for g in gathered[1:])
    # distribute_saved_activations: the saved input is split across TP ranks and re-gathered for recompute.
    ref = _grads(False, True)
    got = _grads(True, True, distribute=True, group=state.tp_group)
    ok = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ref[0], got[0])) and torch.allclose(ref[1], got[1])
    ps.destroy_model_parallel()
    return same_outside, same_inside, ok


def test_tp_ranks_share_default_stream_but_not_model_parallel_stream():
    for same_outside, same_inside, distributed_ckpt_ok in run_distributed(_tp_rng_body, 2):
        assert same_outside  # dropout outside the fork (e.g. on replicated activations) matches on all TP ranks
        assert not same_inside  # inside "model-parallel-rng" each TP rank draws its own mask
        assert distributed_ckpt_ok
