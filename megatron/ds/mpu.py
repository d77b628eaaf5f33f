"""DeepSpeed's ``mpu`` object (Megatron's old module interface) over our `ParallelState`.

DeepSpeed asks ``mpu`` for the data-parallel group (gradient all-reduce, ZeRO partitioning), the model-parallel
group (grad-norm and overflow reductions; here the tensor x pipeline group as in Megatron) and the tensor-parallel
rank/size (checkpoint file names ``mp_rank_XX`` and which copy of a replicated parameter counts in the grad norm).
As in Megatron-DeepSpeed, ``get_model_parallel_rank``/``world_size`` are the tensor-parallel ones.
"""
from __future__ import annotations

from typing import Any, List, Optional

from megatron.core import parallel_state as ps


class MegatronMPU:
    """The ``mpu`` argument of ``deepspeed.initialize`` / ``deepspeed.checkpointing.configure``."""

    def __init__(self, state: Optional[ps.ParallelState] = None) -> None:
        self._state = state

    @property
    def state(self) -> ps.ParallelState:
        return ps.current_parallel_state(self._state)

    # model parallel (Megatron-DeepSpeed: rank/size are tensor-parallel, the group spans tensor x pipeline)
    def get_model_parallel_group(self) -> Any:
        return self.state.mp_group

    def get_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.state.tp_size

    # tensor parallel
    def get_tensor_model_parallel_group(self) -> Any:
        return self.state.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.state.tp_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.state.tp_src_rank()

    # pipeline parallel
    def get_pipeline_model_parallel_group(self) -> Any:
        return self.state.pp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.state.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.state.pp_size

    # data parallel
    def get_data_parallel_group(self) -> Any:
        return self.state.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.state.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.state.dp_size

    def get_data_parallel_group_ranks(self) -> List[int]:
        return list(self.state.dp_ranks())


def get_mpu(state: Optional[ps.ParallelState] = None) -> MegatronMPU:
    """An adapter bound to `state` (or to the current parallel state when None)."""
    return MegatronMPU(state)
