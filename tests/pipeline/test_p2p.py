"""P2P between pipeline stages over gloo (batch_isend_irecv): values arrive at the right neighbour, received
activations require grad, and MEGATRON_DEBUG_P2P logging names every operation with its peer and shape."""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.pipeline._p2p_worker import exchange


def test_p2p_chain_over_gloo() -> None:
    res = run_distributed(exchange, 3)
    assert res[0]["act"] is None
    assert torch.equal(res[1]["act"], torch.full((4, 2, 3), 1.0)) and res[1]["requires_grad"]
    assert torch.equal(res[2]["act"], torch.full((4, 2, 3), 3.0))  # 1 (stage 0) + 2 (stage 1)
    assert torch.equal(res[2]["grad"], torch.full((4, 2, 3), 10.0))
    assert torch.equal(res[1]["grad"], torch.full((4, 2, 3), 20.0))  # stage 2 sent back 2 x its grad
    assert torch.equal(res[0]["grad"], torch.full((4, 2, 3), 40.0))
    log1 = res[1]["log"]
    for op, peer in (("recv_forward", 0), ("send_forward", 2), ("recv_backward", 2), ("send_backward", 0)):
        assert f"rank 1 (pp 1): {op} peer {peer} shape (4, 2, 3) torch.float32" in log1, log1
    assert "send_forward" not in res[2]["log"] and "recv_forward" not in res[0]["log"]
