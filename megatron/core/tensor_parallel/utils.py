"""Tensor-splitting helpers and vocabulary partitioning for tensor parallelism."""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch

from megatron.core.tensor_parallel.mappings import all_gather_along_dim, group_rank, group_size
from megatron.core.utils import divide, ensure_divisibility

__all__ = [
    "divide",
    "ensure_divisibility",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
    "gather_split_1d_tensor",
    "VocabUtility",
]


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Sequence[torch.Tensor]:
    """Split `tensor` into `num_partitions` equal chunks along its last dim (views unless made contiguous)."""
    last_dim_size = divide(tensor.size(-1), num_partitions, "split_tensor_along_last_dim")
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(c.contiguous() for c in chunks)
    return chunks


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, group: Any, new_buffer: bool = False) -> torch.Tensor:
    """This rank's 1/world slice of the flattened tensor (numel must divide by the group size)."""
    world = group_size(group)
    flat = tensor.reshape(-1)
    part = divide(flat.numel(), world, "split_tensor_into_1d_equal_chunks")
    start = part * group_rank(group)
    chunk = flat[start : start + part]
    return chunk.clone() if new_buffer else chunk


def gather_split_1d_tensor(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Inverse of `split_tensor_into_1d_equal_chunks`: the flat concatenation of every rank's chunk."""
    return all_gather_along_dim(tensor.reshape(-1), group, 0)


class VocabUtility:
    """Contiguous vocabulary ranges [first, last) owned by each tensor-parallel rank."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> Tuple[int, int]:
        del world_size  # every partition has the same size
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
        if global_vocab_size % world_size != 0:
            raise ValueError(
                f"vocabulary size {global_vocab_size} is not divisible by the tensor-parallel size {world_size}; "
                f"pad it (--make-vocab-size-divisible-by) so each rank owns an equal slice"
            )
        per_partition = global_vocab_size // world_size
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


def chunk_ranges(total: int, parts: int) -> List[Tuple[int, int]]:
    """[start, end) of each of `parts` equal pieces of `total`."""
    size = divide(total, parts)
    return [(i * size, (i + 1) * size) for i in range(parts)]
