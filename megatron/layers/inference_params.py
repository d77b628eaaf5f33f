"""Key/value cache bookkeeping for incremental decoding (Megatron's InferenceParams)."""
from __future__ import annotations

import torch


class InferenceParams:
    """Per-generation state: batch/sequence offsets and the per-layer key/value cache.

    Attention layers allocate `key_value_memory_dict[layer_number] = (keys, values)` of shape
    [max_sequence_length, max_batch_size, query_groups_per_partition, head_dim] on first use (with GQA the
    groups' K/V, not expanded to the query heads; without GQA one group per head). Multi-latent attention
    (megatron/models/deepseek/mla.py) caches (latents [S, B, kv_lora_rank], rope keys [S, B, qk_pos_emb_head_dim])
    under the same key instead: what its layers need per token, shared by all heads.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int) -> None:
        self.max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def swap_key_value_dict(self, batch_idx: torch.Tensor) -> None:
        """Reorder the cached batch entries (beam search)."""
        if not self.key_value_memory_dict:
            raise ValueError("swap_key_value_dict: the key/value cache is empty")
        for layer_number, (keys, values) in self.key_value_memory_dict.items():
            self.key_value_memory_dict[layer_number] = (keys[:, batch_idx], values[:, batch_idx])
