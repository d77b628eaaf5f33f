"""CheckpointSettings: what megatron/checkpoint/checkpointing.py and the DeepSpeed checkpoint code read from the flags."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

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
        heads = getattr(args, "num_attention_heads", None)
        qkv_heads = qkv_dim = None
        if heads and not getattr(args, "group_query_attention", False):
            qkv_heads = heads // (getattr(args, "tensor_model_parallel_size", 1) or 1)
            qkv_dim = getattr(args, "kv_channels", None) or args.hidden_size // heads
        return cls(
            save=getattr(args, "save", None),
            load=getattr(args, load_arg, None),
            no_save_optim=bool(getattr(args, "no_save_optim", False)),
            no_save_rng=bool(getattr(args, "no_save_rng", False)),
            no_load_optim=bool(getattr(args, "no_load_optim", False)),
            no_load_rng=bool(getattr(args, "no_load_rng", False)),
            finetune=bool(getattr(args, "finetune", False)),
            ckpt_format=getattr(args, "ckpt_format", "torch") or "torch",
            auto_detect_ckpt_format=bool(getattr(args, "auto_detect_ckpt_format", False)),
            keep_last_n_checkpoints=getattr(args, "keep_last_n_checkpoints", None),
            trust_checkpoint=bool(getattr(args, "trust_checkpoint", False)),
            no_checkpoint_fallback=bool(getattr(args, "no_checkpoint_fallback", False)),
            exit_on_missing_checkpoint=bool(getattr(args, "exit_on_missing_checkpoint", False)),
            true_vocab_size=getattr(args, "true_vocab_size", None),
            rank=int(getattr(args, "rank", 0) or 0),
            parallel_sizes=tuple((attr, getattr(args, attr, None)) for _, attr in PARALLEL_SIZE_FLAGS),
            qkv_heads_per_rank=qkv_heads,
            qkv_head_dim=qkv_dim,
        )
