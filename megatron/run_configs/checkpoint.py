"""CheckpointSettings: what megatron/checkpoint/ (saving.py, loading.py, selection.py) and the DeepSpeed checkpoint code read from the flags."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import fill_from_args, flag_value

# The parallel sizes a checkpoint must match (flag, attribute); a different one is refused with a reshard hint.
PARALLEL_SIZE_FLAGS = (
    ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
    ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
    ("--expert-model-parallel-size", "expert_model_parallel_size"),
)


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Where checkpoints go and come from, and which parts are saved and loaded."""

    save: Optional[str] = None
    load: Optional[str] = None  # the folder load_checkpoint reads (the flag named by ``load_arg``)
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    ckpt_format: str = "torch"
    auto_detect_ckpt_format: bool = False
    keep_last_n_checkpoints: Optional[int] = None
    trust_checkpoint: bool = False
    no_checkpoint_fallback: bool = False
    exit_on_missing_checkpoint: bool = False
    true_vocab_size: Optional[int] = None
    rank: int = 0
    # The parallel sizes of this run by attribute name (None: not set), compared with a checkpoint's.
    parallel_sizes: tuple[tuple[str, Optional[int]], ...] = ()
    # Old (checkpoint_version < 2) QKV row order: attention heads per tensor rank and the head size; None when the
    # model has no multi-head attention to reorder (no heads, or grouped-query attention).
    qkv_heads_per_rank: Optional[int] = None
    qkv_head_dim: Optional[int] = None

    def parallel_size(self, attr: str) -> Optional[int]:
        return dict(self.parallel_sizes).get(attr)

    @classmethod
    def from_args(cls, args: argparse.Namespace, load_arg: str = "load") -> CheckpointSettings:
        heads = flag_value(args, "num_attention_heads")
        qkv_heads = qkv_dim = None
        if heads and not flag_value(args, "group_query_attention"):
            qkv_heads = heads // (flag_value(args, "tensor_model_parallel_size") or 1)
            qkv_dim = flag_value(args, "kv_channels") or args.hidden_size // heads
        return fill_from_args(
            cls, args,
            load=getattr(args, load_arg, None),
            parallel_sizes=tuple((attr, getattr(args, attr, None)) for _, attr in PARALLEL_SIZE_FLAGS),
            qkv_heads_per_rank=qkv_heads,
            qkv_head_dim=qkv_dim,
        )
