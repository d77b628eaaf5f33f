"""Data-parallel wrappers (local contiguous-buffer DDP, torch DDP) and post-backward gradient reductions."""
from megatron.core.distributed.distributed_data_parallel import (
    DistributedDataParallel,
    GradBuffer,
    TorchDistributedDataParallel,
)
from megatron.core.distributed.finalize_model_grads import (
    allreduce_embedding_grads,
    allreduce_sequence_parallel_grads,
    finalize_model_grads,
)

__all__ = [
    "DistributedDataParallel",
    "GradBuffer",
    "TorchDistributedDataParallel",
    "allreduce_embedding_grads",
    "allreduce_sequence_parallel_grads",
    "finalize_model_grads",
]
