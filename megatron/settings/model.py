"""Model-shape settings (--help group "network size"): layers, widths, attention, positions, norms, activations.

Most are `TransformerConfig` fields and part of the checkpoint's architecture record (megatron/settings/declare.py).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, ClassVar, List, Optional, Union

from megatron.enums import position_embedding_name
from megatron.settings.declare import ConfigField, extra_flag, setting
from megatron.settings.moe import moe_freq_type


# How the config fields that are not plain copies of one setting are computed (from validated args: validate_args
# has folded --use-rotary-position-embeddings / --no-position-embedding into --position-embedding-type and filled
# --num-query-groups and the padded vocabulary).
def _position_embedding_type(args: argparse.Namespace) -> Any:
    return position_embedding_name(args.position_embedding_type)  # a Megatron-DeepSpeed checkpoint's args: an enum


def _num_query_groups(args: argparse.Namespace) -> Any:
    return args.num_query_groups if args.group_query_attention else None


def _padded_vocab_size(args: argparse.Namespace) -> Any:
    return getattr(args, "padded_vocab_size", None) or 0


def _share_embeddings_and_output_weights(args: argparse.Namespace) -> Any:
    return not args.untie_embeddings_and_output_weights


def window_size_type(text: str) -> tuple:
    """--window-size "W,R" or "(W,R)" -> (W, R), Megatron-LM's tuple_type ("[W,R]", a checkpoint's record, too)."""
    try:
        return tuple(int(x) for x in str(text).strip().strip("()[]").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window-size {text!r}: give two integers W,R such as 4095,0") from None


# --use-checkpoint-args: the destinations a saved field value sets.
_RESTORE_POSITION_EMBEDDING_TYPE = (("position_embedding_type", lambda v: v),
                                    ("use_rotary_position_embeddings", lambda v: v == "rope"),
                                    ("add_position_embedding", lambda v: v == "learned_absolute"))
_RESTORE_SHARE_EMBEDDINGS_AND_OUTPUT_WEIGHTS = (("untie_embeddings_and_output_weights", lambda v: not v),)


@dataclasses.dataclass
class NetworkSizeSettings:
    """--help group "network size"."""

    TITLE: ClassVar[str] = "network size"
    num_layers: Optional[int] = setting("--num-layers", help="Number of transformer layers.", config=True, arch=24, kept=0)
    encoder_num_layers: Optional[int] = setting("--encoder-num-layers", help="Number of encoder layers (T5).",
        config=True, arch=25)
    decoder_num_layers: Optional[int] = setting("--decoder-num-layers", help="Number of decoder layers (T5).",
        config=True, arch=26, families=("t5",))
    hidden_size: Optional[int] = setting("--hidden-size", help="Transformer hidden size.", config=True, arch=27, kept=1)
    ffn_hidden_size: Optional[int] = setting("--ffn-hidden-size", help="MLP hidden size (default 4 * hidden-size).",
        config=True, arch=29, kept=3)
    num_attention_heads: Optional[int] = setting("--num-attention-heads", help="Number of attention heads.",
        config=True, arch=28, kept=2)
    kv_channels: Optional[int] = setting("--kv-channels",
        help="Projection size per head (default hidden-size // num-attention-heads).", config=True, arch=30, kept=4)
    max_position_embeddings: Optional[int] = setting("--max-position-embeddings",
        help="Largest sequence length supported.", config=True, arch=31, kept=5)
    position_embedding_type: str = setting("--position-embedding-type", default="learned_absolute",
        choices=["learned_absolute", "rope", "alibi", "none", "absolute", "rotary"],
        help="Position embedding: learned absolute (GPT-2), rotary (Llama), ALiBi linear biases (BLOOM), or none; "
             "Megatron-DeepSpeed's names absolute/rotary are accepted.",
        config=ConfigField(compute=_position_embedding_type, arch=12, kept=17, restore=_RESTORE_POSITION_EMBEDDING_TYPE))
    use_rotary_position_embeddings: bool = setting("--use-rotary-position-embeddings", default=False,
        help="Megatron-LM 23.06 spelling of --position-embedding-type rope.", feeds=("position_embedding_type",))
    add_position_embedding: bool = setting("--no-position-embedding", default=True,
        help="No learned absolute position embedding (with rope: the rotary embedding only).",
        feeds=("position_embedding_type",))
    rotary_percent: float = setting("--rotary-percent", default=1.0,
        help="Fraction of each head's channels that RoPE rotates (0 < p <= 1).", config=True, arch=14, kept=19)
    rotary_base: float = setting("--rotary-base", default=10000.0,
        help="RoPE base (theta): 10000 for Llama-2, 1e6 for Mistral v0.3, 500000 for Llama-3.", config=True, arch=13, kept=18)
    rotary_seq_len_interpolation_factor: Optional[float] = setting("--rotary-seq-len-interpolation-factor",
        help="Linear position interpolation: RoPE rotates position p as p / factor (HF rope_type linear; Megatron-LM "
             "parses an int, any positive number is accepted here).", config=True, arch=17, kept=25)
    use_rope_scaling: bool = setting("--use-rope-scaling", default=False,
        help="Llama-3.1 RoPE frequency scaling (HF rope_type llama3), as Megatron-LM.", config=True, arch=18, kept=26)
    rope_scaling_factor: float = setting("--rope-scaling-factor", default=8.0,
        help="Llama-3.1 scaling factor with --use-rope-scaling (8 for Llama-3.1, 32 for Llama-3.2).", config=True,
        arch=19, kept=27)
    rope_scaling_low_freq_factor: float = setting("--rope-scaling-low-freq-factor", default=1.0,
        help="Llama-3.1 low_freq_factor with --use-rope-scaling (Megatron-LM hard-codes 1).", config=True, arch=20, kept=28)
    rope_scaling_high_freq_factor: float = setting("--rope-scaling-high-freq-factor", default=4.0,
        help="Llama-3.1 high_freq_factor with --use-rope-scaling (Megatron-LM hard-codes 4).", config=True, arch=21, kept=29)
    rope_scaling_original_max_position_embeddings: int = setting("--rope-scaling-original-max-position-embeddings",
        default=8192, help="Llama-3.1 original context length with --use-rope-scaling (Megatron-LM hard-codes 8192).",
        config=True, arch=22, kept=30)
    # YaRN (Megatron-LM core 0.16.1: --rope-type, --rotary-scaling-factor, --mscale, --mscale-all-dim; the original
    # context, beta and rounding flags are Megatron-LM main's --yarn-* spellings; 0.16.1 hard-codes 4096, 32, 1, True)
    rope_type: Optional[str] = setting("--rope-type", choices=["rope", "yarn"],
        help="RoPE kind: rope, or yarn (YaRN frequencies and cos/sin concentration, HF rope_type yarn). Default: yarn "
             "with --multi-latent-attention, rope otherwise (Megatron-LM; its 0.16.1 refuses yarn outside MLA, here "
             "it applies to any rotary attention).", config=True, arch=48, kept=48)
    rotary_scaling_factor: float = setting("--rotary-scaling-factor", default=1.0,
        help="YaRN scaling factor (HF rope_scaling factor): the context-extension ratio.", config=True, arch=49, kept=49)
    mscale: float = setting("--mscale", default=1.0,
        help="YaRN mscale: cos/sin are multiplied by mscale(factor, mscale) / mscale(factor, mscale-all-dim).",
        config=True, arch=50, kept=50)
    mscale_all_dim: float = setting("--mscale-all-dim", default=0.0,
        help="YaRN mscale_all_dim (the denominator above; multi-latent attention also scales its softmax by "
             "mscale(factor, mscale-all-dim)^2).", config=True, arch=51, kept=51)
    original_max_position_embeddings: int = setting("--yarn-original-max-position-embeddings", default=4096,
        help="YaRN's original (pretraining) context length: where its correction range is computed.",
        config=ConfigField(arch=52, kept=52, hint="--yarn-original-max-position-embeddings"))
    beta_fast: float = setting("--yarn-beta-fast", default=32.0,
        help="YaRN beta_fast: dimensions turning more often than this over the original context keep their frequency.",
        config=ConfigField(arch=53, kept=53, hint="--yarn-beta-fast"))
    beta_slow: float = setting("--yarn-beta-slow", default=1.0,
        help="YaRN beta_slow: dimensions turning less often than this are fully interpolated.",
        config=ConfigField(arch=54, kept=54, hint="--yarn-beta-slow"))
    yarn_correction_range_round_to_int: bool = setting("--no-yarn-correction-range-round-to-int", default=True,
        help="Do not round YaRN's correction range to whole dimensions (HF truncate: false, as GPT-OSS).",
        also=(extra_flag("--yarn-correction-range-round-to-int", action="store_true", default=True,
                         help="Round it (the default)."),),
        config=ConfigField(arch=55, kept=55, hint="--no-yarn-correction-range-round-to-int (or not)"))
    normalization: str = setting("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
        help="Normalization layer: LayerNorm (GPT-2/BERT) or RMSNorm (Llama).", config=True, arch=0, kept=8)
    group_query_attention: bool = setting("--group-query-attention", default=False,
        help="Grouped-query attention: --num-query-groups K/V heads shared by the query heads.", config=True, arch=15, kept=20,
        feeds=("num_query_groups",))
    num_query_groups: Optional[int] = setting("--num-query-groups",
        help="Number of K/V head groups with --group-query-attention (default 1: multi-query).",
        config=ConfigField(compute=_num_query_groups, arch=16, kept=21, hint="--group-query-attention --num-query-groups"))
    qk_layernorm: bool = setting("--qk-layernorm", default=False,
        help="Per-head --normalization norm on the queries and keys before RoPE (Qwen3; Megatron Core's "
             "q_layernorm / k_layernorm).", config=True, arch=56, kept=56)
    # multi-latent attention (megatron/models/deepseek/mla.py), Megatron-LM's flags and defaults
    multi_latent_attention: bool = setting("--multi-latent-attention", default=False,
        help="Multi-latent attention (DeepSeek-V2/V3): low-rank query and key/value latents, RoPE on a decoupled "
             "positional part of each head.", config=True, arch=57, kept=57)
    q_lora_rank: Optional[int] = setting("--q-lora-rank",
        help="Rank of the query latent with --multi-latent-attention (default none: one query projection).",
        config=True, arch=58, kept=58)
    kv_lora_rank: int = setting("--kv-lora-rank", default=32,
        help="Rank of the key/value latent with --multi-latent-attention.", config=True, arch=59, kept=59)
    qk_head_dim: int = setting("--qk-head-dim", default=128,
        help="Per-head query/key channels without position with --multi-latent-attention.", config=True, arch=60, kept=60)
    qk_pos_emb_head_dim: int = setting("--qk-pos-emb-head-dim", default=64,
        help="Per-head query/key channels RoPE rotates with --multi-latent-attention.", config=True, arch=61, kept=61)
    v_head_dim: int = setting("--v-head-dim", default=128,
        help="Per-head value channels with --multi-latent-attention.", config=True, arch=62, kept=62)
    window_size: Optional[tuple] = setting("--window-size", type=window_size_type,
        help="Sliding-window attention W,R: each query attends the W keys before it and itself (R, the look-ahead, "
             "is 0 for a causal decoder); not set: global attention.", config=True, arch=64, kept=64)
    window_attn_skip_freq: Optional[Union[int, List[int]]] = setting("--window-attn-skip-freq", type=moe_freq_type,
        help="With --window-size: every N-th layer attends globally (int N), or a 0/1 list pattern per layer such as "
             "\"([1]*3+[0])*2\" (1 = sliding window); not set: every layer uses the window.", config=True, arch=65,
        kept=65)
    add_bias_linear: bool = setting("--disable-bias-linear", default=True,
        help="No biases in the linear layers (QKV, attention output, MLP).", config=ConfigField(arch=9, kept=15,
        hint="--disable-bias-linear (or not)"))
    add_qkv_bias: bool = setting("--add-qkv-bias", default=False,
        help="Keep the QKV bias even with --disable-bias-linear (Qwen-style).", config=True, arch=10, kept=16)
    make_vocab_size_divisible_by: int = setting("--make-vocab-size-divisible-by", default=128,
        help="Pad the vocab so its size is divisible by this value (times TP size).",
        config=ConfigField("padded_vocab_size", compute=_padded_vocab_size, arch=32, kept=6,
        hint="the same vocab file and --make-vocab-size-divisible-by"), restore_if_unset=True)
    layernorm_epsilon: float = setting("--layernorm-epsilon", "--norm-epsilon", default=1e-05,
        help="Epsilon of the LayerNorm/RMSNorm layers.", config=ConfigField(arch=1, kept=9, hint="--norm-epsilon"))
    apply_layernorm_1p: bool = setting("--apply-layernorm-1p", default=False,
        help="LayerNorm with (1 + weight) (zero-centered).", config=True, arch=2, kept=10)
    apply_residual_connection_post_layernorm: bool = setting("--apply-residual-connection-post-layernorm",
        default=False, help="Residual connection after the layer norm (original BERT).", config=True, arch=3, kept=7)
    openai_gelu: bool = setting("--openai-gelu", default=False, help="OpenAI's tanh GeLU approximation.", config=True,
        arch=4, kept=11)
    squared_relu: bool = setting("--squared-relu", default=False, help="Squared ReLU activation instead of GeLU.",
        config=True, arch=5, kept=12)
    swiglu: bool = setting("--swiglu", default=False, help="SwiGLU activation instead of GeLU.", config=True, arch=6, kept=13)
    glu_activation: Optional[str] = setting("--glu-activation", choices=["geglu", "liglu", "reglu", "swiglu"],
        help="Megatron-DeepSpeed's GLU activations: x1 * act(x2) over the two halves of a 2 * ffn first projection "
             "(act = GeLU, identity, ReLU, SiLU).", config=True, arch=7, kept=23)
    embed_layernorm: bool = setting("--embed-layernorm", default=False,
        help="LayerNorm right after the word embeddings (BLOOM; Megatron-DeepSpeed's flag).", config=True, arch=8, kept=24)
    onnx_safe: Optional[bool] = setting("--onnx-safe", type=bool, help="Workarounds for known ONNX exporter problems.",
        feeds=("bias_gelu_fusion",))
    bert_binary_head: bool = setting("--bert-no-binary-head", default=True,
        help="Disable BERT's binary (next-sentence) head.", families=("bert",))
    untie_embeddings_and_output_weights: bool = setting("--untie-embeddings-and-output-weights", default=False,
        help="Separate input embedding and output layer weights.",
        config=ConfigField("share_embeddings_and_output_weights", compute=_share_embeddings_and_output_weights, arch=23, kept=22,
        hint="--untie-embeddings-and-output-weights (or not)", restore=_RESTORE_SHARE_EMBEDDINGS_AND_OUTPUT_WEIGHTS))
    # ---- GPT-OSS (issue #38): attention sinks and the clamped, offset GLU (Megatron-LM core 0.16.1's names)
    softmax_type: str = setting("--softmax-type", default="vanilla", choices=["vanilla", "off-by-one", "learnable"],
        help="Attention softmax: vanilla, off-by-one (a zero logit added to each row's denominator) or learnable "
             "(a learned per-head sink logit, self_attention.core_attention.softmax_offset; GPT-OSS).", config=True, arch=69, kept=69)
    quick_geglu: bool = setting("--quick-geglu", default=False,
        help="Gated MLP with quick GeLU x * sigmoid(1.702 x) on the gate half (GPT-OSS).", config=True, arch=70, kept=70)
    glu_linear_offset: float = setting("--glu-linear-offset", default=0.0,
        help="Gated MLP: act(gate) * (up + offset) (GPT-OSS: 1.0).", config=True, arch=71, kept=71)
    activation_func_clamp_value: Optional[float] = setting("--activation-func-clamp-value", type=float,
        help="Gated MLP: clamp the gate half to <= value and the linear half to [-value, value] before the "
             "activation (GPT-OSS: 7.0).", config=True, arch=72, kept=72)
    mtp_num_layers: Optional[int] = setting("--mtp-num-layers",
        help="Multi-token prediction (DeepSeek-V3): D sequential MTP modules after the decoder on the last pipeline "
             "stage, the k-th predicting token i+k+1 (megatron/layers/mtp.py); None: none.", config=True,
        arch=63, kept=63, families=("gpt",))
    mtp_loss_scaling_factor: float = setting("--mtp-loss-scaling-factor", default=0.1,
        help="The mean of the D MTP losses times this factor is added to the LM loss (with --mtp-num-layers).",
        config=True, families=("gpt",))
