"""Typed configuration objects that replace Megatron's global `args` inside the package.

`megatron.arguments.core_transformer_config_from_args(args)` builds a `TransformerConfig` from parsed flags;
layers and models receive it (and their process groups) explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class ModelParallelConfig:
    """Parallel layout and numerics shared by every layer."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    fp16: bool = False
    bf16: bool = False
    # Initialise the full (unsharded) weight on CPU from the global seed, then keep this rank's shard:
    # makes TP=N weights bitwise equal to TP=1 weights for the same seed (Megatron's --use-cpu-initialization).
    use_cpu_initialization: bool = True
    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = False
    deterministic_mode: bool = False


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Architecture of a Megatron transformer (GPT/BERT/T5 share it)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size
    kv_channels: Optional[int] = None  # default hidden_size // num_attention_heads
    max_position_embeddings: int = 512
    padded_vocab_size: int = 0  # vocab size after Megatron's padding (set by the tokenizer stage)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    apply_residual_connection_post_layernorm: bool = False
    openai_gelu: bool = False
    fp32_residual_connection: bool = False
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    masked_softmax_fusion: bool = True
    bias_gelu_fusion: bool = False
    bias_dropout_fusion: bool = False
    use_flash_attn: bool = False
    # Activation recomputation: None | "selective" | "full"; method "uniform" | "block".
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    distribute_saved_activations: bool = False
    # Output layer shares the word-embedding weight (Megatron's default for GPT).
    share_embeddings_and_output_weights: bool = True
    init_method: Optional[Callable] = field(default=None, repr=False)
    output_layer_init_method: Optional[Callable] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                    f"({self.num_attention_heads}), or pass --kv-channels"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.tensor_model_parallel_size != 0:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--tensor-model-parallel-size ({self.tensor_model_parallel_size})"
            )
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Normal(0, sigma) initialiser, Megatron's `init_method_normal`."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Normal(0, sigma / sqrt(2 * num_layers)) for output projections (Megatron's `scaled_init_method_normal`)."""
    std = sigma / (2.0 * num_layers) ** 0.5

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_
