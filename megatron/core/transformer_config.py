"""Typed configuration objects that replace Megatron's global `args` inside the package.

`megatron.arguments.core_transformer_config_from_args(args)` builds a `TransformerConfig` from parsed flags;
layers and models receive it (and their process groups) explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class ModelParallelConfig:
    """Parallel layout and numerics shared by every layer."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    """Ranks the sequence is split over (megatron/core/context_parallel.py); the layers get the group explicitly."""
    cp_comm_type: str = "p2p"
    """Context-parallel attention: "p2p" (ring), "all_gather" or "a2a" (--cp-comm-type)."""
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
    glu_activation: Optional[str] = None
    """Megatron-DeepSpeed's gated MLP (--glu-activation geglu|liglu|reglu|swiglu): dense_h_to_4h has 2 * ffn rows,
    each TP rank's output is split in halves [x1; x2] and the MLP computes x1 * act(x2) (act: erf GeLU, identity,
    ReLU, SiLU)."""
    quick_geglu: bool = False
    """Gated MLP x_glu * sigmoid(1.702 x_glu) * (x_linear + glu_linear_offset) (--quick-geglu; GPT-OSS)."""
    glu_linear_offset: float = 0.0
    """Offset added to the linear half of a gated MLP: act(gate) * (up + offset) (--glu-linear-offset)."""
    activation_func_clamp_value: Optional[float] = None
    """Gated MLP: gate clamped to <= value, linear half to [-value, value] (--activation-func-clamp-value)."""
    softmax_type: str = "vanilla"
    """Attention softmax: "vanilla", "off-by-one" (a zero logit in every row's denominator) or "learnable" (a
    learned per-head sink logit ``core_attention.softmax_offset``, split over TP with the heads) (--softmax-type)."""
    bias_gelu_fusion: bool = True
    """Megatron's fused bias+GeLU, which computes the tanh approximation (plain GeLU MLP with a bias only)."""
    # ---- biases
    add_bias_linear: bool = True
    """Biases in the QKV, attention output and MLP linears (--disable-bias-linear sets False)."""
    add_qkv_bias: bool = False
    """Bias in query_key_value even with add_bias_linear False (Qwen-style, --add-qkv-bias)."""
    # ---- positions
    position_embedding_type: str = "learned_absolute"
    """"learned_absolute" (position_embeddings table), "rope" (rotary, half-split convention), "alibi" (BLOOM's
    per-head linear biases on the attention scores, no position table) or "none"."""
    embed_layernorm: bool = False
    """LayerNorm right after the word embeddings (BLOOM; Megatron-DeepSpeed's --embed-layernorm), stored as
    ``word_embeddings.norm`` as Megatron-DeepSpeed does."""
    rotary_base: float = 10000.0
    """RoPE base theta (--rotary-base)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates, 0 < p <= 1 (--rotary-percent)."""
    rotary_seq_len_interpolation_factor: Optional[float] = None
    """Linear position interpolation: RoPE rotates position p by the angles of p / f
    (--rotary-seq-len-interpolation-factor; HF rope_type "linear" with factor f)."""
    use_rope_scaling: bool = False
    """Llama-3.1 RoPE frequency scaling (--use-rope-scaling; HF rope_type "llama3") with the four values below."""
    rope_scaling_factor: float = 8.0
    """Llama-3.1 scaling factor (--rope-scaling-factor; Megatron-LM's default 8)."""
    rope_scaling_low_freq_factor: float = 1.0
    """Llama-3.1 low_freq_factor (--rope-scaling-low-freq-factor; Megatron-LM hard-codes 1)."""
    rope_scaling_high_freq_factor: float = 4.0
    """Llama-3.1 high_freq_factor (--rope-scaling-high-freq-factor; Megatron-LM hard-codes 4)."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """Llama-3.1 original context length (--rope-scaling-original-max-position-embeddings; Megatron-LM: 8192)."""
    rope_type: Optional[str] = None
    """"rope" or "yarn" (--rope-type); None is Megatron-LM's default: yarn with multi-latent attention, else rope."""
    rotary_scaling_factor: float = 1.0
    """YaRN scaling factor (--rotary-scaling-factor; HF rope_scaling factor)."""
    mscale: float = 1.0
    """YaRN mscale (--mscale): cos/sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    mscale_all_dim: float = 0.0
    """YaRN mscale_all_dim (--mscale-all-dim); multi-latent attention's softmax scale has its square."""
    original_max_position_embeddings: int = 4096
    """YaRN's original context length (--yarn-original-max-position-embeddings; Megatron-LM core's 4096)."""
    beta_fast: float = 32.0
    """YaRN beta_fast (--yarn-beta-fast)."""
    beta_slow: float = 1.0
    """YaRN beta_slow (--yarn-beta-slow)."""
    yarn_correction_range_round_to_int: bool = True
    """Round YaRN's correction range to whole dimensions (HF truncate; --no-yarn-correction-range-round-to-int)."""
    # ---- attention heads
    group_query_attention: bool = False
    """Grouped-query attention: num_query_groups K/V heads shared by the query heads (--group-query-attention)."""
    num_query_groups: Optional[int] = None
    """Number of K/V heads (1 = multi-query); resolved to num_attention_heads when GQA is off."""
    qk_layernorm: bool = False
    """A `normalization` norm over each head's channels on q and k, after the QKV split and before RoPE
    (Qwen3; --qk-layernorm): ``self_attention.q_layernorm`` / ``k_layernorm``, their grads summed over TP."""
    window_size: Optional[tuple] = None
    """Sliding-window attention (--window-size W,R): query i attends keys i-W .. i+R (Megatron Core's
    (left, right); a causal decoder takes R = 0); None = global attention."""
    window_attn_skip_freq: Any = None
    """Which layers use the window (--window-attn-skip-freq): None all; int N: every N-th layer (1-based) is global;
    a list of 0/1 per layer, 1 = sliding window."""
    # ---- multi-latent attention (DeepSeek-V2/V3; megatron/models/deepseek/mla.py; Megatron Core's names)
    multi_latent_attention: bool = False
    """Multi-latent attention instead of ParallelAttention: queries and keys/values through low-rank latents, RoPE on
    a decoupled positional part of each head (--multi-latent-attention)."""
    q_lora_rank: Optional[int] = None
    """Rank of the query latent (--q-lora-rank); None: one plain query projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 32
    """Rank of the key/value latent (--kv-lora-rank), what the KV cache holds per token with the rope key."""
    qk_head_dim: int = 128
    """Per-head query/key channels without position (--qk-head-dim); a head's q/k is qk_head_dim +
    qk_pos_emb_head_dim wide."""
    qk_pos_emb_head_dim: int = 64
    """Per-head query/key channels that RoPE rotates (--qk-pos-emb-head-dim); the key's part is shared by the heads."""
    v_head_dim: int = 128
    """Per-head value channels (--v-head-dim)."""
    # ---- encoder/decoder models
    encoder_num_layers: Optional[int] = None
    """Encoder layers of an encoder-decoder model (--encoder-num-layers); None = num_layers."""
    decoder_num_layers: Optional[int] = None
    """Decoder layers of an encoder-decoder model (--decoder-num-layers); None = num_layers."""
    # ---- mixture of experts (Megatron-LM core's names; megatron/layers/moe.py)
    num_moe_experts: Optional[int] = None
    """Experts per MoE layer; None = dense MLP everywhere (--num-experts)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Inner size of each routed expert (--moe-ffn-hidden-size); None = ffn_hidden_size."""
    moe_router_topk: int = 2
    """Experts each token is sent to (--moe-router-topk)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """aux_loss | seq_aux_loss | sinkhorn | none (--moe-router-load-balancing-type)."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss (--moe-aux-loss-coeff)."""
    moe_z_loss_coeff: Optional[float] = None
    """Coefficient of the router z-loss; None = off (--moe-z-loss-coeff)."""
    moe_per_layer_logging: bool = False
    """The router losses also as TensorBoard scalars per layer, moe/<name>_layer_<i> (--moe-per-layer-logging)."""
    moe_router_pre_softmax: bool = False
    """Score function before top-k (Qwen/DeepSeek) instead of softmax over the k chosen logits."""
    moe_router_score_function: str = "softmax"
    """softmax | sigmoid (--moe-router-score-function)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiplies the routing weights (--moe-router-topk-scaling-factor)."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: the experts in this many equal groups (--moe-router-num-groups); None = off."""
    moe_router_group_topk: Optional[int] = None
    """Groups each token may use, ranked by the sum of their top-(topk/group_topk) scores (--moe-router-group-topk)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: experts chosen by sigmoid score + a per-expert bias updated every iteration."""
    moe_router_bias_update_rate: float = 1e-3
    """The expert bias moves by this much per iteration towards balance (--moe-router-bias-update-rate)."""
    moe_router_dtype: Optional[str] = None
    """fp32 | fp64: dtype of the router logits and routing weights; None = the activations' dtype."""
    moe_expert_capacity_factor: Optional[float] = None
    """Tokens per expert at most ceil(tokens * topk / experts * factor); None = dropless."""
    moe_token_drop_policy: str = "probs"
    """Which tokens an over-full expert drops: the lowest-probability ones (probs) or the latest (position)."""
    moe_pad_expert_input_to_capacity: bool = False
    """Every expert computes exactly `capacity` rows (padding with unrouted tokens at zero weight)."""
    moe_layer_freq: Any = 1
    """int N: layers 0, N, 2N, ... (0-based) are MoE; or a list of 0/1 per layer (--moe-layer-freq)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Inner size of the shared expert(s) every token also passes through; None = none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . gate_weight) (Qwen2-MoE)."""
    moe_apply_probs_on_input: bool = False
    """Multiply the expert input (not the activation) by the routing weight (top-1 only)."""
    expert_model_parallel_size: int = 1
    """Ranks the experts of a layer are sharded over (--expert-model-parallel-size); expert-TP = TP."""
    moe_token_dispatcher_type: str = "allgather"
    """How tokens reach expert-parallel ranks: allgather | alltoall (--moe-token-dispatcher-type)."""
    # ---- multi-token prediction (Megatron-LM core's names; megatron/layers/mtp.py)
    mtp_num_layers: Optional[int] = None
    """MTP depths D after the decoder, on the last pipeline stage (--mtp-num-layers); None = no MTP."""
    mtp_loss_scaling_factor: float = 0.1
    """The mean of the D MTP losses times this is added to the LM loss (--mtp-loss-scaling-factor)."""
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
        if self.glu_activation not in (None, "geglu", "liglu", "reglu", "swiglu"):
            raise ValueError(f"--glu-activation must be geglu, liglu, reglu or swiglu, got {self.glu_activation!r}")
        activations = [n for n in ("openai_gelu", "squared_relu", "swiglu", "glu_activation", "quick_geglu")
                       if getattr(self, n)]
        if len(activations) > 1:
            raise ValueError("choose one MLP activation: " + " and ".join("--" + a.replace("_", "-")
                                                                         for a in activations) + " were given together")
        self._validate_gpt_oss_parts()
        if self.position_embedding_type not in ("learned_absolute", "rope", "alibi", "none"):
            raise ValueError("--position-embedding-type must be learned_absolute, rope, alibi or none, "
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
            problem = rope_scaling_problem(self) or yarn_problem(self)
            if problem:
                raise ValueError(problem)
        elif self.use_rope_scaling or self.rotary_seq_len_interpolation_factor is not None:
            raise ValueError("--use-rope-scaling / --rotary-seq-len-interpolation-factor need --position-embedding-type "
                             f"rope (got {self.position_embedding_type})")
        elif yarn_problem(self):
            raise ValueError(yarn_problem(self))
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
        if self.multi_latent_attention:
            self._validate_mla()
        if self.num_moe_experts is not None:
            self._validate_moe()
        if self.window_size is not None:
            self._validate_window()
        if self.mtp_num_layers is not None:
            self._validate_mtp()
        for name in ("encoder_num_layers", "decoder_num_layers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    def _validate_gpt_oss_parts(self) -> None:
        if self.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"--softmax-type must be vanilla, off-by-one or learnable, got {self.softmax_type!r}")
        if self.softmax_type != "vanilla" and self.context_parallel_size > 1:
            raise ValueError(f"--softmax-type {self.softmax_type} does not run under context parallelism; use "
                             "--context-parallel-size 1")
        glu_knobs = self.glu_linear_offset != 0.0 or self.activation_func_clamp_value is not None
        if glu_knobs and not (self.swiglu or self.quick_geglu):
            raise ValueError("--glu-linear-offset / --activation-func-clamp-value need a gated MLP (--swiglu or "
                             "--quick-geglu)")
        if self.activation_func_clamp_value is not None and self.activation_func_clamp_value <= 0:
            raise ValueError(f"--activation-func-clamp-value must be positive, got {self.activation_func_clamp_value}")

    def _validate_window(self) -> None:
        window = tuple(int(x) for x in self.window_size)
        if len(window) != 2 or window[0] < 0:
            raise ValueError(f"--window-size takes two integers W,R with W >= 0 (got {self.window_size})")
        if window[1] != 0:
            raise ValueError(f"--window-size {window[0]},{window[1]}: a causal decoder looks no token ahead; "
                             f"pass --window-size {window[0]},0")
        self.window_size = window
        if self.multi_latent_attention:
            raise ValueError("--window-size is implemented for the standard attention; --multi-latent-attention has "
                             "no sliding window here: drop one of them")
        freq = self.window_attn_skip_freq
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"--window-attn-skip-freq must be >= 1, got {freq}")
        if isinstance(freq, (list, tuple)) and len(freq) != self.num_layers:
            raise ValueError(f"--window-attn-skip-freq lists {len(freq)} layers but --num-layers is {self.num_layers}")

    def is_window_layer(self, layer_number: int) -> bool:
        """Whether 1-based layer `layer_number` uses sliding-window attention (Megatron Core's rule)."""
        if not self.window_size:
            return False
        freq = self.window_attn_skip_freq
        if freq is None:
            return True
        if isinstance(freq, int):
            return layer_number % freq != 0
        return bool(freq[layer_number - 1])
    def _validate_mla(self) -> None:
        if self.group_query_attention:
            raise ValueError("--multi-latent-attention and --group-query-attention exclude each other (as Megatron-LM)")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"--q-lora-rank must be >= 1 (or left out), got {self.q_lora_rank}")
        if int(self.qk_pos_emb_head_dim * self.rotary_percent) % 2:
            raise ValueError(f"--rotary-percent {self.rotary_percent} of --qk-pos-emb-head-dim "
                             f"{self.qk_pos_emb_head_dim} must give an even rotary dimension")
        if self.use_rope_scaling or self.rotary_seq_len_interpolation_factor is not None:
            raise ValueError("--use-rope-scaling / --rotary-seq-len-interpolation-factor do not apply to "
                             "--multi-latent-attention (Megatron-LM's MLA rotates with --rotary-base only)")
        if self.position_embedding_type == "alibi":
            raise ValueError("--multi-latent-attention rotates its positional part itself: use --position-embedding-"
                             "type rope (or none), not alibi")
        if self.context_parallel_size > 1:
            raise ValueError("--multi-latent-attention runs at --context-parallel-size 1 (the context-parallel "
                             "attention takes one head dim for q/k and v); use tensor + sequence parallelism")
        if self.use_flash_attn:
            raise ValueError("--use-flash-attn does not apply to --multi-latent-attention (its q/k and v head dims "
                             "differ; it runs torch scaled_dot_product_attention): drop --use-flash-attn")

    def _validate_mtp(self) -> None:
        if self.mtp_num_layers < 1:
            raise ValueError(f"--mtp-num-layers must be >= 1, got {self.mtp_num_layers} (omit it for no MTP)")
        if self.position_embedding_type not in ("rope", "none"):
            raise ValueError(f"--mtp-num-layers needs --position-embedding-type rope or none (got "
                             f"{self.position_embedding_type}), as in Megatron-LM")
        if self.context_parallel_size > 1:
            raise ValueError("--mtp-num-layers with --context-parallel-size > 1 is not implemented (the shifted "
                             "tokens cross context-parallel ranks); use tensor, sequence or pipeline parallelism")

    def _validate_moe(self) -> None:
        experts, topk = self.num_moe_experts, self.moe_router_topk
        if experts < 1:
            raise ValueError(f"--num-experts must be >= 1, got {experts}")
        if not 1 <= topk <= experts:
            raise ValueError(f"--moe-router-topk ({topk}) must be between 1 and --num-experts ({experts})")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if topk == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax \
                and self.moe_router_load_balancing_type != "sinkhorn":
            raise ValueError("--moe-router-topk 1 needs --moe-router-pre-softmax (softmax over one logit is 1), "
                             "as in Megatron-LM")
        if self.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "sinkhorn", "none"):
            raise ValueError("--moe-router-load-balancing-type must be aux_loss, seq_aux_loss, sinkhorn or none, "
                             f"got {self.moe_router_load_balancing_type!r}")
        if self.moe_router_load_balancing_type == "sinkhorn" and self.moe_aux_loss_coeff:
            raise ValueError("--moe-router-load-balancing-type sinkhorn takes no --moe-aux-loss-coeff (set it to 0)")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"--moe-router-score-function must be softmax or sigmoid, "
                             f"got {self.moe_router_score_function!r}")
        if self.moe_router_topk_scaling_factor is not None and not self.moe_router_pre_softmax \
                and self.moe_router_score_function == "softmax":
            raise ValueError("--moe-router-topk-scaling-factor needs --moe-router-pre-softmax (or the sigmoid score "
                             "function), as in Megatron-LM")
        self._validate_router_groups()
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid, as in "
                             "Megatron-LM")
        if self.moe_token_drop_policy not in ("probs", "position"):
            raise ValueError(f"--moe-token-drop-policy must be probs or position, got {self.moe_token_drop_policy!r}")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor <= 0:
            raise ValueError(f"--moe-expert-capacity-factor must be positive, got {self.moe_expert_capacity_factor}")
        if self.moe_apply_probs_on_input and topk != 1:
            raise ValueError("--moe-apply-probs-on-input needs --moe-router-topk 1")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(f"--moe-router-dtype must be fp32 or fp64, got {self.moe_router_dtype!r}")
        pattern = self.moe_layer_pattern
        if len(pattern) != self.num_layers:
            raise ValueError(f"--moe-layer-freq lists {len(pattern)} layers but --num-layers is {self.num_layers}")
        if self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
            raise ValueError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (as Megatron-LM)")

    def _validate_router_groups(self) -> None:
        groups, group_topk, experts = self.moe_router_num_groups, self.moe_router_group_topk, self.num_moe_experts
        if groups is not None and not group_topk:
            raise ValueError("--moe-router-num-groups needs --moe-router-group-topk (the groups each token may use)")
        if not group_topk:
            return
        if not groups:
            raise ValueError("--moe-router-group-topk needs --moe-router-num-groups, as in Megatron-LM")
        if groups < 1 or experts % groups:
            raise ValueError(f"--moe-router-num-groups ({groups}) must divide --num-experts ({experts})")
        if not 1 <= group_topk <= groups:
            raise ValueError(f"--moe-router-group-topk ({group_topk}) must be between 1 and --moe-router-num-groups "
                             f"({groups})")
        if not group_topk <= self.moe_router_topk <= group_topk * (experts // groups):
            raise ValueError(f"--moe-router-topk ({self.moe_router_topk}) must be between --moe-router-group-topk "
                             f"({group_topk}) and the experts of the chosen groups ({group_topk * (experts // groups)})")
        if self.moe_router_load_balancing_type == "sinkhorn":
            raise ValueError("--moe-router-group-topk does not apply to --moe-router-load-balancing-type sinkhorn")

    @property
    def moe_layer_pattern(self) -> list:
        """1 (MoE) or 0 (dense MLP) for each layer, from moe_layer_freq (all 0 without experts)."""
        if self.num_moe_experts is None:
            return [0] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq < 1:
                raise ValueError(f"--moe-layer-freq must be >= 1, got {freq}")
            return [1 if i % freq == 0 else 0 for i in range(self.num_layers)]
        pattern = [int(x) for x in freq]
        if any(x not in (0, 1) for x in pattern):
            raise ValueError(f"--moe-layer-freq list must hold only 0 and 1, got {freq}")
        return pattern

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates: int(kv_channels * rotary_percent) (Megatron's rounding)."""
        dim = self.kv_channels
        return int(dim * self.rotary_percent) if self.rotary_percent < 1.0 else dim

    @property
    def gated_linear_unit(self) -> bool:
        """True when the MLP's first linear holds two halves per rank (SwiGLU [gate; up], --glu-activation)."""
        return self.swiglu or self.quick_geglu or self.glu_activation is not None


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


def rope_scaling_problem(c: Any) -> Optional[str]:
    """One line naming the RoPE-scaling flag whose value cannot work (None if all can); `c` is a TransformerConfig
    or the parsed args (the same names). Scaling values without --use-rope-scaling would be ignored: refused."""
    f = c.rotary_seq_len_interpolation_factor
    if f is not None and not f > 0:
        return f"--rotary-seq-len-interpolation-factor must be positive (got {f})"
    names = ("rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
             "rope_scaling_original_max_position_embeddings")
    if not c.use_rope_scaling:
        given = [n for n, default in zip(names, (8.0, 1.0, 4.0, 8192)) if getattr(c, n) != default]
        return f"--{given[0].replace('_', '-')} needs --use-rope-scaling" if given else None
    for name in names:
        if not getattr(c, name) > 0:
            return f"--{name.replace('_', '-')} must be positive (got {getattr(c, name)})"
    if not c.rope_scaling_high_freq_factor > c.rope_scaling_low_freq_factor:
        return (f"--rope-scaling-high-freq-factor ({c.rope_scaling_high_freq_factor}) must exceed "
                f"--rope-scaling-low-freq-factor ({c.rope_scaling_low_freq_factor})")
    return None


YARN_DEFAULTS = (("rotary_scaling_factor", 1.0), ("mscale", 1.0), ("mscale_all_dim", 0.0),
                 ("original_max_position_embeddings", 4096), ("beta_fast", 32.0), ("beta_slow", 1.0),
                 ("yarn_correction_range_round_to_int", True))
_YARN_FLAGS = {"original_max_position_embeddings": "--yarn-original-max-position-embeddings",
               "beta_fast": "--yarn-beta-fast", "beta_slow": "--yarn-beta-slow",
               "yarn_correction_range_round_to_int": "--no-yarn-correction-range-round-to-int"}


def yarn_problem(c: Any) -> Optional[str]:
    """One line naming the YaRN flag whose value cannot work or would be ignored (None if all can); `c` is a
    TransformerConfig or the parsed args. Without --rope-type yarn (or multi-latent attention, whose softmax scale
    reads --rotary-scaling-factor / --mscale-all-dim) YaRN values are refused; YaRN does not combine with the
    other RoPE scalings."""
    mla = bool(getattr(c, "multi_latent_attention", False))
    yarn = getattr(c, "rope_type", None) == "yarn" or (mla and getattr(c, "rope_type", None) is None)
    rope = getattr(c, "position_embedding_type", "rope") in ("rope", "rotary") or mla
    if getattr(c, "rope_type", None) is not None and not rope:
        return f"--rope-type {c.rope_type} needs --position-embedding-type rope (got {c.position_embedding_type})"
    if not (yarn and rope):
        given = [n for n, default in YARN_DEFAULTS if getattr(c, n, default) != default
                 and not (mla and n in ("rotary_scaling_factor", "mscale_all_dim"))]
        if given:
            return f"{_YARN_FLAGS.get(given[0], '--' + given[0].replace('_', '-'))} needs --rope-type yarn"
        return None
    if c.use_rope_scaling or c.rotary_seq_len_interpolation_factor is not None:
        return "--rope-type yarn does not combine with --use-rope-scaling / --rotary-seq-len-interpolation-factor"
    for name in ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        if not getattr(c, name) > 0:
            return f"{_YARN_FLAGS.get(name, '--' + name.replace('_', '-'))} must be positive (got {getattr(c, name)})"
    return None
