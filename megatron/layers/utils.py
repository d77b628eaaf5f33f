"""Small helpers used across the model code: initialisers, activations, masks, group sizes."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer_config import init_method_normal, scaled_init_method_normal

__all__ = [
    "init_method_normal",
    "scaled_init_method_normal",
    "attention_mask_func",
    "get_linear_layer",
    "gelu_impl",
    "openai_gelu",
    "erf_gelu",
    "group_size",
    "group_rank",
    "resolve_tp_group",
    "pp_size_of",
    "check_model_layout",
]


def group_size(group: Optional[object]) -> int:
    """World size of a process group; None (or no torch.distributed) means a single rank."""
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def group_rank(group: Optional[object]) -> int:
    """This process's rank inside `group`; 0 when `group` is None."""
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group=group)


def resolve_tp_group(tp_group: Optional[object], pp_state: Optional[object]) -> Optional[object]:
    """The tensor-parallel group a model builds with: `tp_group` when given, else `pp_state`'s (None: one rank)."""
    if tp_group is None and pp_state is not None:
        return getattr(pp_state, "tp_group", None)
    return tp_group


def pp_size_of(pp_state: Optional[object]) -> int:
    """Pipeline stages of `pp_state` (a ParallelState or anything with `pp_size`); 1 when there is none."""
    return getattr(pp_state, "pp_size", 1) if pp_state is not None else 1


def check_model_layout(model: str, config: object, tp_group: Optional[object], pp_state: Optional[object], *,
                       check_pp: bool = True) -> int:
    """Refuse a model whose config disagrees with its groups (one line naming the fix); returns the TP size.

    Checks that the padded vocabulary is set and divides over TP ranks, that `tp_group` has
    config.tensor_model_parallel_size ranks and (with `check_pp`) that `pp_state` has
    config.pipeline_model_parallel_size stages."""
    if config.padded_vocab_size <= 0:
        raise ValueError("TransformerConfig.padded_vocab_size is not set: build the tokenizer first "
                         "(it sets args.padded_vocab_size) or pass padded_vocab_size")
    tp = group_size(tp_group)
    if tp != config.tensor_model_parallel_size:
        raise ValueError(f"{model}: config.tensor_model_parallel_size={config.tensor_model_parallel_size} but the "
                         f"tp_group has {tp} ranks; pass tp_group=parallel_state.tp_group (or pp_state=parallel_state)")
    pp = pp_size_of(pp_state)
    if check_pp and pp != config.pipeline_model_parallel_size:
        raise ValueError(f"{model}: config.pipeline_model_parallel_size={config.pipeline_model_parallel_size} but "
                         f"pp_state has pp_size={pp}; pass pp_state=parallel_state")
    if config.padded_vocab_size % tp:
        raise ValueError(f"padded vocab size {config.padded_vocab_size} is not divisible by "
                         f"--tensor-model-parallel-size {tp}; pad it with --make-vocab-size-divisible-by")
    return tp


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Fill masked-out positions (mask True) with -10000.0, as Megatron does (in place)."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def get_linear_layer(rows: int, columns: int, init_method: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.Linear:
    """A plain (not tensor-parallel) linear layer with `init_method` weights and zero bias."""
    layer = torch.nn.Linear(rows, columns)
    init_method(layer.weight)
    with torch.no_grad():
        layer.bias.zero_()
    return layer


def gelu_impl(x: torch.Tensor) -> torch.Tensor:
    """OpenAI's tanh approximation of gelu (HF's "gelu_new"), as torch's one-kernel tanh GeLU.

    Same formula as 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))) to within ~2e-7, but one fused
    kernel forward and backward instead of seven element-wise ops (about 7x faster on CPU)."""
    return F.gelu(x, approximate="tanh")


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's --openai-gelu activation (tanh approximation)."""
    return gelu_impl(x)


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact gelu written with erf (Megatron's --onnx-safe variant); equal to F.gelu."""
    return x * 0.5 * (torch.erf(x / math.sqrt(2.0)) + 1.0)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's default activation: exact (erf) gelu."""
    return F.gelu(x)
