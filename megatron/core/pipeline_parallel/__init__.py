"""Forward/backward schedules over micro-batches (no pipelining for now; pipelined schedules later)."""
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_forward_backward_func

__all__ = ["forward_backward_no_pipelining", "get_forward_backward_func"]
