"""FLOPs of one training iteration, from the model config: the TFLOPs of the training log line.

Megatron-LM's `num_floating_point_operations` (core_v0.7; reduces to Narayanan et al. 2021's
72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) for a plain GPT):

    12·B·s·l·h² · [ (1 + g/n + s/h)·(q/h)  +  (f/h)·γ  +  V/(2·l·h) ]

with B the global batch (samples per iteration), s the sequence length, l layers, h hidden size, n attention heads,
g query groups (n without GQA), q = kv_channels·n the query projection size, f the FFN hidden size, γ = 3/2 for
SwiGLU (three FFN matmuls instead of two) and V the padded vocabulary. Forward + backward = 3 forward passes, 2 FLOPs
per multiply-add; biases, norms, softmax and the rotary embedding are not counted (as Megatron-LM).

With full activation recomputation (``recompute_granularity == "full"``) the transformer layers run their forward a
second time: their terms are counted 4 times instead of 3 (the logits still 3), which for a plain GPT is the paper's
96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) as Megatron-DeepSpeed's TFLOPs report it. Selective recomputation is not
counted (as in Megatron-LM).

Multi-token prediction (--mtp-num-layers D, `mtp_flops`) adds, as Megatron-LM counts it, D transformer layers, D more
logits and per depth its norms and eh_proj, 6·B·s·(3h + 2h²).

Multi-latent attention (``config.multi_latent_attention``) replaces the attention term by Megatron-LM core 0.16's MLA
count (`mla_attention_macs`) per token and layer: the q latent and up projection, or the plain q projection without
q-lora, r_q·(h + n·(d_qk + d_pe) + 1) | h·n·(d_qk + d_pe); the kv latent and up projection r_kv·(h + n·(d_qk + d_v) + 1)
plus the rope key h·d_pe; the output projection n·d_v·h; the two attention matmuls s·n·(d_qk + d_pe) + s·n·d_v,
counted over all s x s scores as this module counts every attention (Megatron-LM 0.16 halves them for the causal
mask).
"""
from __future__ import annotations

from megatron.core.transformer_config import TransformerConfig


def transformer_and_logit_flops(config: TransformerConfig, batch_size: int, seq_length: int) -> tuple[float, float]:
    """(transformer layers, logits) FLOPs of one forward + backward over `batch_size` sequences."""
    b, s, layers, h = batch_size, seq_length, config.num_layers, config.hidden_size
    n = config.num_attention_heads
    g = config.num_query_groups or n
    q = config.kv_channels * n
    gated = 1.5 if config.gated_linear_unit else 1.0
    if config.multi_latent_attention:
        per_h2 = mla_attention_macs(config, s) / (2.0 * h * h) + (config.ffn_hidden_size / h) * gated
    else:
        per_h2 = (1.0 + g / n + s / h) * (q / h) + (config.ffn_hidden_size / h) * gated
    transformer = 12.0 * b * s * layers * h * h * per_h2
    logits = 6.0 * b * s * h * config.padded_vocab_size
    return transformer, logits


def mtp_flops(config: TransformerConfig, transformer: float, logits: float, batch_size: int,
              seq_length: int) -> tuple[float, float]:
    """(layer, other) FLOPs the multi-token-prediction depths add to a decoder whose layers and logits cost
    `transformer` and `logits` (Megatron-LM's count): each depth's transformer layer as a decoder layer, its norms
    and eh_proj 6·B·s·(3h + 2h²), its logits; zeros without --mtp-num-layers."""
    depths, h = config.mtp_num_layers or 0, config.hidden_size
    norms_and_proj = 6.0 * batch_size * seq_length * depths * (3 * h + 2 * h * h)
    return transformer * depths / config.num_layers, logits * depths + norms_and_proj


def mla_attention_macs(config: TransformerConfig, seq_length: int) -> float:
    """Multiply-adds per token of one multi-latent-attention layer (see the module docstring)."""
    h, n, s = config.hidden_size, config.num_attention_heads, seq_length
    qk, pe, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    if config.q_lora_rank is None:
        q_term = h * n * (qk + pe)
    else:
        q_term = config.q_lora_rank * (h + n * (qk + pe) + 1)
    kv_term = config.kv_lora_rank * (h + n * (qk + v) + 1) + h * pe
    return float(q_term + kv_term + n * v * h + s * n * (qk + pe) + s * n * v)


def num_floating_point_operations(config: TransformerConfig, batch_size: int, seq_length: int) -> float:
    """FLOPs of one training iteration of `batch_size` sequences (see the module docstring)."""
    transformer, logits = transformer_and_logit_flops(config, batch_size, seq_length)
    mtp_layers, mtp_other = mtp_flops(config, transformer, logits, batch_size, seq_length)
    transformer += mtp_layers
    if config.recompute_granularity == "full":
        transformer *= 4.0 / 3.0
    return transformer + logits + mtp_other


def bert_num_floating_point_operations(config: TransformerConfig, batch_size: int, seq_length: int,
                                       binary_head: bool = True) -> float:
    """FLOPs of one BERT training iteration: the encoder layers as GPT's (bidirectional attention multiplies the
    same matrices), the LM head's dense h x h before the tied logits h x V at every position, and with the binary
    head the pooler's h x h and the binary head's h x 2 once per sequence (on the first token)."""
    transformer, logits = transformer_and_logit_flops(config, batch_size, seq_length)
    if config.recompute_granularity == "full":
        transformer *= 4.0 / 3.0
    h = config.hidden_size
    head = 6.0 * batch_size * seq_length * h * h
    if binary_head:
        head += 6.0 * batch_size * (h * h + 2 * h)
    return transformer + logits + head
