"""ConversionOptions: what the built-in loader and saver plugins (megatron/checkpoint/conversion/plugins.py) read.

tools/checkpoint/convert.py's namespace (its base flags plus the ones each plugin adds) is Megatron-LM's plugin
protocol; the built-ins read it once, here, with the defaults their parsers give an absent flag (a plugin's flags are
only there when that plugin was chosen, and a caller may hand a namespace of its own).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

# The --target-* sizes a writer of unsharded models (--saver hf) refuses unless they are absent or 1.
SHARDING_TARGETS = ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                    "target_num_layers_per_virtual_pipeline_stage")


@dataclasses.dataclass(frozen=True)
class ConversionOptions:
    """The source and destination, the source's reading options and the output's layout."""

    load_dir: Optional[str] = None
    save_dir: Optional[str] = None
    model_type: Optional[str] = None
    true_vocab_size: Optional[int] = None
    trust_checkpoint: bool = False
    iteration: Optional[int] = None  # --iteration (the Megatron, Megatron Core and DeepSpeed loaders)
    keep_training_state: bool = False  # set by the driver: the optimizer state travels (--saver megatron/mcore)
    target_tensor_parallel_size: Optional[int] = None
    target_pipeline_parallel_size: Optional[int] = None
    target_num_layers_per_virtual_pipeline_stage: Optional[int] = None
    target_expert_parallel_size: Optional[int] = None  # --saver megatron
    target_pipeline_model_parallel_split_rank: Optional[int] = None  # --saver megatron (T5)
    bigscience_layout: bool = False  # --saver deepspeed
    max_shard_size: str = "2GB"  # --saver hf
    hf_architecture: Optional[str] = None  # --saver hf
    checking: bool = True  # --no-checking turns it off

    def sharding_targets(self) -> tuple[tuple[str, Optional[int]], ...]:
        """(attribute, value) of the --target-* sharding sizes (see SHARDING_TARGETS)."""
        return tuple((name, getattr(self, name)) for name in SHARDING_TARGETS)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConversionOptions:
        return cls(
            load_dir=getattr(args, "load_dir", None),
            save_dir=getattr(args, "save_dir", None),
            model_type=getattr(args, "model_type", None),
            true_vocab_size=getattr(args, "true_vocab_size", None),
            trust_checkpoint=bool(getattr(args, "trust_checkpoint", False)),
            iteration=getattr(args, "iteration", None),
            keep_training_state=bool(getattr(args, "keep_training_state", False)),
            target_tensor_parallel_size=getattr(args, "target_tensor_parallel_size", None),
            target_pipeline_parallel_size=getattr(args, "target_pipeline_parallel_size", None),
            target_num_layers_per_virtual_pipeline_stage=getattr(
                args, "target_num_layers_per_virtual_pipeline_stage", None),
            target_expert_parallel_size=getattr(args, "target_expert_parallel_size", None),
            target_pipeline_model_parallel_split_rank=getattr(args, "target_pipeline_model_parallel_split_rank", None),
            bigscience_layout=bool(getattr(args, "bigscience_layout", False)),
            max_shard_size=getattr(args, "max_shard_size", "2GB"),
            hf_architecture=getattr(args, "hf_architecture", None),
            checking=bool(getattr(args, "checking", True)),
        )
