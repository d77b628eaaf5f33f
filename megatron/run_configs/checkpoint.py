"""CheckpointSettings: what megatron/checkpoint/ (saving.py, loading.py, selection.py) and the DeepSpeed checkpoint code read from the flags."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, flag_value, from_settings
from megatron.settings.values import Settings

# The parallel sizes a checkpoint must match (flag, attribute); a different one is refused with a reshard hint.
PARALLEL_SIZE_FLAGS = (
    ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
    ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
    ("--expert-model-parallel-size", "expert_model_parallel_size"),
)


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Where checkpoints go and come from, and which parts are saved and loaded."""

    settings: Settings = dataclasses.field(repr=False)
    load: Optional[str] = None  # the folder load_checkpoint reads (the flag named by ``load_arg``)
    true_vocab_size: Optional[int] = None
    rank: int = 0
    # The parallel sizes of this run by attribute name (None: not set), compared with a checkpoint's.
    parallel_sizes: tuple[tuple[str, Optional[int]], ...] = ()
    # Old (checkpoint_version < 2) QKV row order: attention heads per tensor rank and the head size; None when the
    # model has no multi-head attention to reorder (no heads, or grouped-query attention).
    qkv_heads_per_rank: Optional[int] = None
    qkv_head_dim: Optional[int] = None

    save = SettingValue()
    no_save_optim = SettingValue()
    no_save_rng = SettingValue()
    no_load_optim = SettingValue()
    no_load_rng = SettingValue()
    finetune = SettingValue()
    ckpt_format = SettingValue()
    auto_detect_ckpt_format = SettingValue()
    keep_last_n_checkpoints = SettingValue()
    trust_checkpoint = SettingValue()
    no_checkpoint_fallback = SettingValue()
    exit_on_missing_checkpoint = SettingValue()
    async_save = SettingValue()
    use_persistent_ckpt_worker = SettingValue()

    def parallel_size(self, attr: str) -> Optional[int]:
        return dict(self.parallel_sizes).get(attr)

    @classmethod
    def from_args(cls, args: argparse.Namespace, load_arg: str = "load",
                  settings: Optional[Settings] = None) -> CheckpointSettings:
        heads = flag_value(args, "num_attention_heads")
        qkv_heads = qkv_dim = None
        if heads and not flag_value(args, "group_query_attention"):
            qkv_heads = heads // (flag_value(args, "tensor_model_parallel_size") or 1)
            qkv_dim = flag_value(args, "kv_channels") or args.hidden_size // heads
        return from_settings(
            cls, args, settings,
            load=getattr(args, load_arg, None),
            parallel_sizes=tuple((attr, getattr(args, attr, None)) for _, attr in PARALLEL_SIZE_FLAGS),
            qkv_heads_per_rank=qkv_heads,
            qkv_head_dim=qkv_dim,
        )
