"""Micro-batch schedules: no pipelining, 1F1B and interleaved 1F1B, plus P2P between pipeline stages."""
from megatron.core.pipeline_parallel.pipelined import (
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_forward_backward_func

__all__ = [
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
]
