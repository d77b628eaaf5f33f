"""Expert parallelism at the layer: our MoELayer with its experts sharded over 2 gloo ranks (allgather and alltoall
dispatchers) gives every rank the output, input gradient, router gradient and aux losses of the unsharded layer on
that rank's tokens, and expert gradients equal to the unsharded layers' summed over the ranks (what the
expert-data-parallel reduction then averages); top-1/top-2, capacity dropping with and without padding, GeLU
experts, a shared expert. One 2-process launch."""
from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.model._moe_ep_workers import ep_layer_worker

pytestmark = pytest.mark.slow

CASES = {
    "top2_swiglu": {},
    "top2_capacity_probs": {"capacity": 0.5},
    "top2_capacity_position_pad": {"capacity": 0.75, "policy": "position", "pad": True},
    "top1_gelu_probs_on_input": {"topk": 1, "glu": False, "pre_softmax": True, "probs_on_input": True},
    "top2_shared": {"shared": 40},
}


def test_expert_parallel_layer_equals_unsharded_layer():
    results = run_distributed(ep_layer_worker, 2, args=(CASES,))
    for rank, per_case in enumerate(results):
        assert len(per_case) == 2 * len(CASES)
        for case, diffs in per_case.items():
            assert {"out", "dx", "drouter", "dw1", "dw2", "loss_load_balancing_loss", "loss_z_loss"} <= set(diffs)
            for key, diff in diffs.items():
                assert diff <= 1e-5, f"rank {rank} {case}: {key} differs from the unsharded layer by {diff}"
