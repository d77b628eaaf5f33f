"""Global grad-norm clipping: equals torch's on one process; on 2 TP ranks with sharded + duplicated params it
counts each param once and gives the serial norm on both ranks."""
import math

import pytest
import torch

from megatron.optimizer import OptimizerConfig, clip_grad_norm_fp32, count_zeros_fp32, get_megatron_optimizer
from megatron.optimizer.clip_grads import grads_for_norm
from tests.dist_utils import run_distributed


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=g) * 3, torch.randn(7, generator=g), torch.randn(2, 2, 2, generator=g)]


def _params_with(grads):
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps


@pytest.mark.parametrize("max_norm, norm_type", [(1.0, 2.0), (100.0, 2.0), (0.5, math.inf), (2.0, 1.0)])
def test_matches_torch_clip_grad_norm(max_norm, norm_type):
    ours, ref = _params_with(_grads()), _params_with(_grads())
    norm = clip_grad_norm_fp32(ours, None, max_norm, norm_type=norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    assert norm == pytest.approx(ref_norm.item(), rel=1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_shared_params_and_zeros():
    ps = _params_with(_grads())
    ps[1].shared = True  # e.g. the tied output embedding on the last stage: not counted
    expected = torch.linalg.vector_norm(torch.cat([ps[0].grad.flatten(), ps[2].grad.flatten()])).item()
    assert len(grads_for_norm(ps)) == 2
    norm = clip_grad_norm_fp32(ps, grads_for_norm(ps), 1e9)
    assert norm == pytest.approx(expected, rel=1e-6)
    ps[0].grad[:2] = 0.0
    ps[1].grad[:] = 0.0  # shared: ignored
    assert count_zeros_fp32(ps) == 6
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.half))
    half.grad = torch.ones(2, dtype=torch.half)
    with pytest.raises(TypeError, match="fp32"):
        clip_grad_norm_fp32([half], None, 1.0)


def _tp_body(rank, world_size):
    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel(tensor_model_parallel_size=2)
    full = _grads(seed=3)
    # param 0 is column-sharded (TP), params 1 and 2 are duplicated on both TP ranks
    shard = torch.nn.Parameter(torch.zeros(5, [2, 1][rank]))
    shard.tensor_model_parallel = True
    shard.partition_dim = 1
    my_shard = full[0][:, :2] if rank == 0 else full[0][:, 2:]
    shard.grad = my_shard.clone()
    dup = _params_with(full[1:])
    ps = [shard] + dup
    norm = clip_grad_norm_fp32(ps, grads_for_norm(ps, state.tp_rank), 1.0, state.mp_group)
    zeros = count_zeros_fp32(ps, state.mp_group, state.tp_rank)
    clipped = [p.grad.clone() for p in ps]
    # same through the optimizer (which reads mp_group / tp_rank from the state)
    model = torch.nn.Module()
    model.a, model.b, model.c = ps
    opt = get_megatron_optimizer(model, OptimizerConfig(clip_grad=1e9, lr=0.0, weight_decay=0.0), state)
    for p, g in zip(ps, [my_shard.clone()] + [g.clone() for g in full[1:]]):
        p.grad = g
    _, opt_norm, _ = opt.step()
    return norm, clipped, zeros, opt_norm


def test_tp2_norm_counts_each_param_once():
    full = _grads(seed=3)
    serial = _params_with(full)
    ref_norm = torch.nn.utils.clip_grad_norm_(serial, 1.0).item()
    results = run_distributed(_tp_body, world_size=2)
    for rank, (norm, grads, zeros, opt_norm) in enumerate(results):
        assert norm == pytest.approx(ref_norm, rel=1e-6)
        assert opt_norm == pytest.approx(ref_norm, rel=1e-6)
        assert zeros == 0
        expected_shard = serial[0].grad[:, :2] if rank == 0 else serial[0].grad[:, 2:]
        torch.testing.assert_close(grads[0], expected_shard, rtol=1e-6, atol=1e-7)
        for g, s in zip(grads[1:], serial[1:]):
            torch.testing.assert_close(g, s.grad, rtol=1e-6, atol=1e-7)
    assert results[0][0] == results[1][0]
