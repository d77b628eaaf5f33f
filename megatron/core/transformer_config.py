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
    perform_initialization: bool = True
    """Initialise the weights with the init methods; False (--no-initialization) only allocates them (their values
    are whatever memory held: for a model whose weights a checkpoint load overwrites next). Biases are still zeroed
    and norms set to ones, as in Megatron-LM."""
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
    init_method_std: float = 0.02
    apply_residual_connection_post_layernorm: bool = False
    fp32_residual_connection: bool = False
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    masked_softmax_fusion: bool = True
    bias_dropout_fusion: bool = False
    use_flash_attn: bool = False
    # ---- normalization
    normalization: str = "LayerNorm"
    """Norm of every layer and the final norm: "LayerNorm" or "RMSNorm" (--normalization)."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every norm (--layernorm-epsilon / --norm-epsilon)."""
    apply_layernorm_1p: bool = False
    """LayerNorm weight stored zero-centred, applied as (1 + weight) (--apply-layernorm-1p)."""
    # ---- MLP activation
    openai_gelu: bool = False
    """MLP activation: OpenAI's tanh GeLU (--openai-gelu)."""
    squared_relu: bool = False
    """MLP activation: relu(x)^2 (--squared-relu)."""
    swiglu: bool = False
    """Gated MLP silu(x W) * (x V); dense_h_to_4h holds [gate; up] per TP rank (--swiglu)."""
    bias_swiglu_fusion: bool = True
    """SwiGLU as one fused bias + SwiGLU kernel on CUDA with Triton (--no-bias-swiglu-fusion: unfused; same numbers)."""
    bias_gelu_fusion: bool = True
    """Megatron's fused bias+GeLU, which computes the tanh approximation (plain GeLU MLP with a bias only)."""
    # ---- biases
    add_bias_linear: bool = True
    """Biases in the QKV, attention output and MLP linears (--disable-bias-linear sets False)."""
    add_qkv_bias: bool = False
    """Bias in query_key_value even with add_bias_linear False (Qwen-style, --add-qkv-bias)."""
    # ---- positions
    position_embedding_type: str = "learned_absolute"
    """"learned_absolute" (position_embeddings table), "rope" (rotary, half-split convention) or "none"."""
    rotary_base: float = 10000.0
    """RoPE base theta (--rotary-base)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates, 0 < p <= 1 (--rotary-percent)."""
    # ---- attention heads
    group_query_attention: bool = False
    """Grouped-query attention: num_query_groups K/V heads shared by the query heads (--group-query-attention)."""
    num_query_groups: Optional[int] = None
    """Number of K/V heads (1 = multi-query); resolved to num_attention_heads when GQA is off."""
    # ---- encoder/decoder models
    encoder_num_layers: Optional[int] = None
    """Encoder layers of an encoder-decoder model (--encoder-num-layers); None = num_layers."""
    decoder_num_layers: Optional[int] = None
    """Decoder layers of an encoder-decoder model (--decoder-num-layers); None = num_layers."""
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
        self._validate_architecture()
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)

    def _validate_architecture(self) -> None:
        """One-line ValueErrors for impossible combinations; resolves num_query_groups."""
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")
        if self.apply_layernorm_1p and self.normalization != "LayerNorm":
            raise ValueError("--apply-layernorm-1p needs --normalization LayerNorm (RMSNorm has no 1p form)")
        activations = [n for n in ("openai_gelu", "squared_relu", "swiglu") if getattr(self, n)]
        if len(activations) > 1:
            raise ValueError("choose one MLP activation: " + " and ".join("--" + a.replace("_", "-")
                                                                         for a in activations) + " were given together")
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError("--position-embedding-type must be learned_absolute, rope or none, "
                             f"got {self.position_embedding_type!r}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding_type == "rope":
            rot_dim = self.rotary_dim
            if rot_dim < 2 or rot_dim % 2:
                raise ValueError(f"--rotary-percent {self.rotary_percent} of --kv-channels {self.kv_channels} "
                                 f"gives rotary dimension {rot_dim}; it must be even and >= 2")
            if self.rotary_base <= 0:
                raise ValueError(f"--rotary-base must be positive, got {self.rotary_base}")
        if not self.group_query_attention:
            if self.num_query_groups not in (None, self.num_attention_heads):
                raise ValueError(f"--num-query-groups {self.num_query_groups} needs --group-query-attention")
            self.num_query_groups = self.num_attention_heads
        elif self.num_query_groups is None:
            self.num_query_groups = 1  # Megatron-LM's default for --num-query-groups
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"--num-query-groups ({self.num_query_groups}) must divide --num-attention-heads "
                             f"({self.num_attention_heads})")
        if self.num_query_groups % self.tensor_model_parallel_size:
            raise ValueError(f"--num-query-groups ({self.num_query_groups}) must be divisible by "
                             f"--tensor-model-parallel-size ({self.tensor_model_parallel_size})")
        for name in ("encoder_num_layers", "decoder_num_layers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates: int(kv_channels * rotary_percent) (Megatron's rounding)."""
        dim = self.kv_channels
        return int(dim * self.rotary_percent) if self.rotary_percent < 1.0 else dim

    @property
    def gated_linear_unit(self) -> bool:
        """True when the MLP's first linear holds [gate; up] (SwiGLU)."""
        return self.swiglu


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
