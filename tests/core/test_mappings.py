"""Forward and backward of every tensor-parallel mapping against the closed-form result, on 2 and 4 gloo ranks."""
from __future__ import annotations

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from tests.dist_utils import run_distributed


def _run(fn, x, group, upstream):
    """y = fn(x); backprop `upstream`; return (y, x.grad)."""
    x = x.clone().requires_grad_(True)
    y = fn(x, group)
    (y * upstream).sum().backward()
    return y.detach(), x.grad


def _mappings_body(rank, world):
    group = ps.initialize_model_parallel(world, 1).tp_group
    torch.manual_seed(0)
    X = torch.randn(2 * world, 3, 5 * world)  # [s, b, h]: both s and h divide by the TP size
    G = torch.randn(2 * world, 3, 5 * world)
    S = sum(r + 1 for r in range(world))
    last = lambda t: torch.chunk(t, world, dim=-1)[rank]  # noqa: E731
    first = lambda t: torch.chunk(t, world, dim=0)[rank]  # noqa: E731
    checks = {}

    y, g = _run(tp.copy_to_tensor_model_parallel_region, X, group, G * (rank + 1))
    checks["copy"] = (y, X, g, G * S)
    y, g = _run(tp.reduce_from_tensor_model_parallel_region, X * (rank + 1), group, G)
    checks["reduce"] = (y, X * S, g, G)
    y, g = _run(tp.scatter_to_tensor_model_parallel_region, X, group, last(G))
    checks["scatter"] = (y, last(X), g, G)
    y, g = _run(tp.gather_from_tensor_model_parallel_region, last(X), group, G)
    checks["gather"] = (y, X, g, last(G))
    y, g = _run(tp.scatter_to_sequence_parallel_region, X, group, first(G))
    checks["sp_scatter"] = (y, first(X), g, G)
    y, g = _run(tp.gather_from_sequence_parallel_region, first(X), group, G * (rank + 1))
    checks["sp_gather_rs"] = (y, X, g, first(G * S))
    y, g = _run(lambda t, grp: tp.gather_from_sequence_parallel_region(t, grp, False), first(X), group, G)
    checks["sp_gather_split"] = (y, X, g, first(G))
    y, g = _run(tp.reduce_scatter_to_sequence_parallel_region, X * (rank + 1), group, first(G))
    checks["sp_reduce_scatter"] = (y, first(X * S), g, G)

    errors = {}
    for name, (y, y_ref, g, g_ref) in checks.items():
        errors[name] = (float((y - y_ref).abs().max()), float((g - g_ref).abs().max()), tuple(y.shape) == y_ref.shape)
    try:
        tp.scatter_to_sequence_parallel_region(torch.randn(2 * world + 1, 2), group)
    except ValueError as e:
        errors["bad_split"] = str(e)
    batch = {"text": torch.arange(12).view(3, 4) + 100, "mask": torch.ones(2, dtype=torch.int64)} if rank == 0 else None
    got = tp.broadcast_data(["text", "mask"], batch, torch.int64, group)
    errors["broadcast"] = (float((got["text"] - (torch.arange(12).view(3, 4) + 100)).abs().max()),
                           float((got["mask"] - 1).abs().max()), tuple(got["mask"].shape) == (2,))
    ps.destroy_model_parallel()
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_forward_backward(world):
    for rank, errors in enumerate(run_distributed(_mappings_body, world)):
        assert "divisible" in errors.pop("bad_split")
        for name, (fwd_err, bwd_err, same_shape) in errors.items():
            assert same_shape, (rank, name)
            assert fwd_err < 1e-5 and bwd_err < 1e-5, (rank, name, fwd_err, bwd_err)


def test_group_none_is_identity():
    x = torch.randn(4, 2, 6, requires_grad=True)
    for fn in (tp.copy_to_tensor_model_parallel_region, tp.reduce_from_tensor_model_parallel_region,
               tp.scatter_to_tensor_model_parallel_region, tp.gather_from_tensor_model_parallel_region,
               tp.scatter_to_sequence_parallel_region, tp.gather_from_sequence_parallel_region,
               tp.reduce_scatter_to_sequence_parallel_region):
        assert fn(x, None) is x
