"""Worker for test_p2p.py (module level so it pickles): exchange activations and grads over gloo."""
from __future__ import annotations

import contextlib
import io

import torch


def exchange(rank: int, world_size: int) -> dict:
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    state = initialize_model_parallel(pipeline_model_parallel_size=world_size)
    try:
        p2p = P2PCommunicator(state, (4, 2, 3), torch.float32, debug=True)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            act = p2p.recv_forward()  # None on the first stage
            out = (act if act is not None else torch.zeros(4, 2, 3)) + rank + 1
            grad = p2p.send_forward_recv_backward(out)  # last stage: nothing sent, None back
            if grad is None:
                grad = torch.full((4, 2, 3), 10.0)
            p2p.send_backward(grad * 2)
        return {"act": act, "grad": grad, "log": err.getvalue(), "requires_grad": bool(act is not None and
                                                                                      act.requires_grad)}
    finally:
        destroy_model_parallel()
