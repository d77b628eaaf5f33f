"""The record a model family fills to say how its checkpoints are laid out beyond the decoder stack every family
shares: its extra top-level modules (their names in Megatron's legacy files and in the conversion stream), how a
checkpoint tells it is the family's, its layer stacks, its names in Megatron Core's torch_dist folders, its own
meta record and the model whose parameters declare its tensor-parallel layouts. Each family declares one in its
folder (megatron/models/<family>/checkpoint_layout.py); megatron/models/registry.py lists them, and the format code
(megatron_format.py, t5_format.py, torch_dist.py, plugins.py, ../formats.py) iterates the declared records instead
of branching on the model type."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from megatron.core.transformer_config import TransformerConfig

# (first stage's flat tensors, last stage's flat tensors) -> the family's own meta record (ModelMeta.extra[extra_key])
Describe = Callable[[Mapping[str, Any], Mapping[str, Any]], Dict[str, Any]]
# (TP=1 config, the family's meta record) -> the model (on the meta device) whose parameters declare the TP layouts
LayoutModel = Callable[[TransformerConfig, Mapping[str, Any]], torch.nn.Module]


@dataclass(frozen=True)
class HeadModule:
    """A top-level module after the final norm (BERT's pooler, LM head, binary head, task heads)."""
    prefix: str  # its flat name prefix in Megatron's legacy files (``lm_head.``, ``language_model.pooler.``)
    message: str  # its message in the conversion stream ("lm head")
    nested: bool = False  # saved one level deep at the top of the model dict (``lm_head`` -> {name: tensor})


@dataclass(frozen=True)
class CheckpointLayout:
    """One family's checkpoint layout in every format (the defaults: a decoder-only stack, GPT's)."""
    model_type: str  # --model-type
    model_class: Optional[type] = None  # its model (how a model being loaded tells its family)
    stacks: Tuple[str, ...] = ("encoder",)  # its layer stacks under ``language_model.`` in Megatron's legacy names
    core_stack: str = "decoder.layers."  # a one-stack model's layers in Megatron Core's torch_dist names
    heads: Tuple[HeadModule, ...] = ()  # its top-level modules after the final norm, in stream order
    markers: Tuple[str, ...] = ()  # last-stage flat name prefixes only this family has (how a checkpoint tells it)
    core_head_objects: Tuple[str, ...] = ()  # its LM head's linears with Megatron Core ShardedObjects (extra state)
    extra_key: Optional[str] = None  # ModelMeta.extra key of its own record
    describe: Optional[Describe] = None  # its own record from a checkpoint's tensors
    layout_model: Optional[LayoutModel] = None  # None: the decoder stack's layouts (tensor_parallel_layouts(config))
    saved_args: Optional[Callable[[argparse.Namespace, Mapping[str, Any]], None]] = None  # its own entries in args

    @property
    def encoder_decoder(self) -> bool:
        """Two stacks (an encoder and a decoder): the encoder-decoder stream of t5_format.py."""
        return len(self.stacks) > 1

    def holds(self, names: Any) -> bool:
        """Whether flat names (a stage's, or a whole model's) are this family's (one of its markers)."""
        return bool(self.markers) and any(k.startswith(self.markers) for k in names)
