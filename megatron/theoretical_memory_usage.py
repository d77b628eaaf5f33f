"""The per-rank memory estimate printed at start-up: parameters, weight + optimizer bytes and activations.

Numbers are for the most loaded rank (the first pipeline stage, which also holds the embeddings):

* parameters are counted exactly for this code base's GPT from its `TransformerConfig` (built from the flags by
  megatron/settings/config_flags.py; BERT adds token types, its LM head, pooler and binary head): query groups (QKV rows (n + 2g)·d), SwiGLU's doubled first projection, biases or
  none (--disable-bias-linear, --add-qkv-bias), LayerNorm (weight and bias) or RMSNorm (weight), learned position
  embeddings only with --position-embedding-type learned_absolute, tied or untied output layer (no bias);
  tensor-parallel split weights count 1/TP, replicated ones (norms, row-parallel biases, position embeddings) in
  full; MoE layers (--num-experts, --moe-layer-freq) hold a replicated router (num_experts x h), the routed experts
  (split over expert-parallel x expert-tensor-parallel ranks) and a TP-split shared expert (its gate replicated);
  the active count takes top-k experts per MoE layer, as Megatron-LM's estimate does; the multi-token-prediction
  block (--mtp-num-layers D, on the last stage: `mtp_parameters`) holds per depth a layer of the decoder's last
  layer's kind, the TP-split eh_proj 2h x h and three norms (`mtp`: its share of the total), and with untied
  embeddings under PP a copy of the word embeddings; multi-latent attention
  (`mla_parameters`) splits its up and output projections over TP and replicates its down projections and latent
  norms;
* bytes per parameter follow the distributed-optimizer table of the Megatron-LM README: replicated bytes (the
  model's params and grads) plus sharded bytes (fp32 main params/grads of mixed precision, optimizer state)
  divided by the data-parallel size under ``--use-distributed-optimizer``: fp32 16 vs 8 + 8/d; bf16 (or fp16
  with fp32 grad accumulation) 18 vs 6 + 12/d; fp16 with fp16 grads 20 vs 4 + 16/d (Adam; SGD's momentum is 4
  bytes instead of Adam's 8);
* activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
  Table 2) with the element size as a parameter e (2 bytes for fp16/bf16, 4 for fp32; dropout masks 1 byte):
  per layer s·b·h·(4e + 2)/t_sp + e·s·b·(2q + 2k)/t + 2e·s·b·f/t + (2e + 1)·a·s²·b/t, where q = a·d is the query
  and k = g·d the key (and value) width (Q, K, V and the projection input), f the FFN width (doubled for SwiGLU:
  gate and up), t the TP size, t_sp = t with sequence parallelism (else 1); the last (attention-score) term is
  dropped by selective recomputation; with multi-latent attention q = a·(d_qk + d_pe) and 2k = q + a·d_v. For e = 2, f = 4h, q = k = h, t = 1 this is the paper's
  s·b·h·(34 + 5·a·s/h). Full recomputation keeps e·s·b·h/t_sp per
  checkpointed unit plus one unit recomputed at a time (block: the first n layers checkpointed, the others kept). The first pipeline stage holds min(PP, micro-batches)
  micro-batches in flight (times Megatron's interleaving penalty 1 + (p - 1)/(p·v)); with PP = 1 the output
  layer's input and the fp32 logits are added.
* context parallelism (--context-parallel-size c) gives each rank s/c of the sequence: every activation term uses
  s/c, and the attention-score term is replaced by the ring attention's saved fp32 softmax statistics (8·a·(s/c)·b/t:
  it recomputes block scores in the backward instead of keeping them).
* BERT (`model_family` "bert") adds, per micro-batch, its int64 padding mask 8·s·b, the bool [b, 1, s, s] attention
  mask s²·b and, with the binary head, the int64 token types 8·s·b; its LM head (with PP = 1) keeps the dense input,
  the GeLU input and the LayerNorm input (e·s·b·h/t_sp each, the head runs on the sequence-parallel shard) besides the
  logits input and fp32 logits GPT counts; the pooler keeps its dense input and tanh output (2e·b·h, the binary head's
  input is the tanh output) and the sentence-order logits are fp32 (4·2·b). T5 is estimated with GPT's formula.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer_config import TransformerConfig
from megatron.run_configs.memory import MemorySettings
from megatron.settings.config_flags import config_kwargs_from_args

MB = 1024.0 * 1024.0


@dataclass
class ParameterCounts:
    """Whole-model counts and the count on the most loaded (tensor, pipeline, expert) rank.

    `active` is what one token passes through (Megatron-LM's "active parameters": the routed experts of a MoE layer
    counted top-k times instead of num_experts times); it equals `total` without experts. `experts` is the routed
    experts' share of `total` (sharded over expert-parallel x expert-tensor-parallel ranks)."""

    transformer_layers: int
    embedding_layers: int
    total: int
    most_loaded_shard: int
    active: int = 0
    experts: int = 0
    mtp: int = 0  # the multi-token-prediction block's share of `total` (Megatron-LM reports it apart)


@dataclass(frozen=True)
class LayerParameters:
    """One transformer layer's parameters by how ranks hold them (whole layer, not divided by any parallel size)."""

    split: int  # tensor-parallel split: QKV, projection, dense MLP or shared expert
    replicated: int  # norms, row-parallel biases, MoE router and shared-expert gate
    experts: int = 0  # routed experts: split over expert-parallel x expert-tensor-parallel ranks
    active_experts: int = 0  # the top-k experts a token passes through


def model_config(args: argparse.Namespace) -> TransformerConfig:
    """The model's `TransformerConfig`, from the flags through megatron/settings/config_flags.py (as the model is built)."""
    return TransformerConfig(**config_kwargs_from_args(TransformerConfig, args))


def _norm_parameters(config: TransformerConfig) -> int:
    return config.hidden_size * (1 if config.normalization == "RMSNorm" else 2)  # RMSNorm has no bias


def _mlp_weights(h: int, f: int, gated: bool) -> int:
    """fc1 (doubled for a gated unit) and fc2 weights of an MLP of inner size f."""
    return h * (2 * f if gated else f) + f * h


def mla_parameters(config: TransformerConfig) -> tuple[int, int]:
    """(TP-split, replicated) parameters of one multi-latent attention: the q up projection (or the plain q
    projection), the kv up projection and the output projection are split over heads; the down projections and the
    latent norms (with --qk-layernorm) are on every rank."""
    h, n = config.hidden_size, config.num_attention_heads
    q_head, per_channel = config.qk_head_dim + config.qk_pos_emb_head_dim, _norm_parameters(config) // h
    norms = int(config.qk_layernorm) * per_channel
    rank = config.q_lora_rank
    split = (h if rank is None else rank) * n * q_head
    replicated = 0 if rank is None else h * rank + norms * rank
    split += config.kv_lora_rank * n * (config.qk_head_dim + config.v_head_dim) + n * config.v_head_dim * h
    replicated += h * (config.kv_lora_rank + config.qk_pos_emb_head_dim) + norms * config.kv_lora_rank
    return split, replicated


def _layer_parameters(config: TransformerConfig, moe: bool = False) -> LayerParameters:
    """One layer's parameters: attention (+ the learnable sinks of --softmax-type learnable, split with the heads),
    norms and a dense MLP or (`moe`) router + routed experts + shared expert (with --add-bias-linear: the router's
    and each expert's fc1/fc2 biases, GPT-OSS)."""
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    gated = config.gated_linear_unit
    q = d * config.num_attention_heads
    qkv = q + 2 * d * (config.num_query_groups or config.num_attention_heads)
    bias = int(config.add_bias_linear)
    qkv_bias = int(config.add_bias_linear or config.add_qkv_bias)
    attention = (h * qkv + qkv_bias * qkv) + q * h  # qkv, dense weight
    if config.softmax_type == "learnable":
        attention += config.num_attention_heads
    norms = 2 * _norm_parameters(config)
    if config.multi_latent_attention:  # its replicated down projections and latent norms count as norms do
        attention, latent = mla_parameters(config)
        norms += latent
    elif config.qk_layernorm:  # --qk-layernorm: a q and a k norm over one head's d channels (replicated)
        norms += 2 * d * (1 if config.normalization == "RMSNorm" else 2)
    if not moe:
        f_in = 2 * f if gated else f
        split = attention + _mlp_weights(h, f, gated) + bias * f_in  # fc1 bias is split, fc2's replicated
        return LayerParameters(split, norms + 2 * bias * h)  # two norms, dense/fc2 biases
    e, topk = config.num_moe_experts, config.moe_router_topk
    fe = config.moe_ffn_hidden_size or f
    expert = _mlp_weights(h, fe, gated) + bias * ((2 * fe if gated else fe) + h)
    shared = config.moe_shared_expert_intermediate_size or 0
    gate = h if shared and config.moe_shared_expert_gate else 0
    return LayerParameters(split=attention + _mlp_weights(h, shared, gated),
                           replicated=norms + bias * h + e * h + bias * e + gate,
                           experts=e * expert, active_experts=topk * expert)


def mtp_parameters(config: TransformerConfig) -> LayerParameters:
    """The multi-token-prediction block's parameters (all D depths): per depth a layer of the kind of the decoder's
    last layer, eh_proj 2h x h (TP-split) and enorm, hnorm, final_layernorm (replicated)."""
    depths = config.mtp_num_layers or 0
    layer = _layer_parameters(config, bool(config.moe_layer_pattern[-1]))
    h = config.hidden_size
    return LayerParameters(depths * (layer.split + 2 * h * h), depths * (layer.replicated + 3 * _norm_parameters(config)),
                           depths * layer.experts, depths * layer.active_experts)


def _bert_extra_parameters(opts: MemorySettings, config: TransformerConfig) -> tuple[int, int, int]:
    """BERT's (token-type embeddings, TP-split head, replicated head) parameters; zeros for other families.

    LM head: dense h x h + bias and LayerNorm (replicated), vocab-parallel bias V; with the binary head also two
    token-type embeddings, the pooler h x h + bias and the binary head h x 2 + bias (replicated). Counted with the
    embedding layers (they sit next to the tied output layer)."""
    if opts.model_family != "bert":
        return 0, 0, 0
    h = config.hidden_size
    binary = opts.bert_binary_head
    head_repl = h * h + h + 2 * h  # the LM head's LayerNorm has a bias whatever --normalization says
    if binary:
        head_repl += h * h + h + 2 * h + 2
    return (2 * h if binary else 0), opts.padded_vocab_size, head_repl


def _settings(args: argparse.Namespace) -> tuple[MemorySettings, TransformerConfig]:
    """The typed inputs of the estimate from the flags (the Megatron-named functions below take ``args``)."""
    return MemorySettings.from_args(args), model_config(args)


def count_parameters(args: argparse.Namespace) -> ParameterCounts:
    """Exact parameter counts of this code base's GPT for `args` (see the module docstring)."""
    return parameter_counts(*_settings(args))


def _stage_parameters(config: TransformerConfig, opts: MemorySettings, stage: int) -> int:
    """Parameters one rank of pipeline stage `stage` holds of its transformer layers: split ones / TP, replicated
    ones whole, routed experts / (EP x expert-TP)."""
    tp = opts.tensor_model_parallel_size
    etp = opts.expert_tensor_parallel_size or tp
    ep = opts.expert_model_parallel_size
    per_stage = config.num_layers // opts.pipeline_model_parallel_size
    pattern = config.moe_layer_pattern
    layers = [_layer_parameters(config, bool(pattern[i])) for i in range(stage * per_stage, (stage + 1) * per_stage)]
    split = sum(x.split for x in layers)
    return split // tp + sum(x.replicated for x in layers) + sum(x.experts for x in layers) // (ep * etp)


def parameter_counts(opts: MemorySettings, config: TransformerConfig) -> ParameterCounts:
    """count_parameters on typed settings."""
    h = config.hidden_size
    tp, pp = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size
    vocab = opts.padded_vocab_size
    layers = [_layer_parameters(config, bool(moe)) for moe in config.moe_layer_pattern]
    word = vocab * h
    position = config.max_position_embeddings * h if config.position_embedding_type == "learned_absolute" else 0
    untied = not config.share_embeddings_and_output_weights
    final_ln = _norm_parameters(config)
    transformer = sum(x.split + x.replicated + x.experts for x in layers) + final_ln
    experts = sum(x.experts for x in layers)
    tokentype, head_split, head_repl = _bert_extra_parameters(opts, config)
    position += tokentype  # replicated on the first stage, like the position table
    position += 2 * h if config.embed_layernorm else 0  # --embed-layernorm: LayerNorm weight and bias, first stage
    embedding = word + position + (word if untied else 0) + head_split + head_repl

    first = _stage_parameters(config, opts, 0) + word // tp + position
    last = _stage_parameters(config, opts, pp - 1) + (word + head_split) // tp + final_ln + head_repl  # tied: own copy
    mtp = mtp_parameters(config)
    etp, ep = opts.expert_tensor_parallel_size or tp, opts.expert_model_parallel_size
    mtp_shard = mtp.split // tp + mtp.replicated + mtp.experts // (ep * etp)
    mtp_shard += word // tp if config.mtp_num_layers and untied and pp > 1 else 0  # the last stage's embedding copy
    if pp == 1:
        shard = first + ((word if untied else 0) + head_split) // tp + final_ln + head_repl + mtp_shard
    else:
        shard = max(first, last + mtp_shard)
    mtp_total = mtp.split + mtp.replicated + mtp.experts
    active = transformer + embedding - experts + sum(x.active_experts for x in layers)
    active += mtp_total - mtp.experts + mtp.active_experts
    return ParameterCounts(transformer, embedding, transformer + embedding + mtp_total, shard, active=active,
                           experts=experts + mtp.experts, mtp=mtp_total)


def bytes_per_parameter(args: argparse.Namespace) -> float:
    """Weight + gradient + optimizer bytes per parameter on one rank (Megatron-LM README's table)."""
    return parameter_bytes(MemorySettings.from_args(args))


def parameter_bytes(opts: MemorySettings) -> float:
    """bytes_per_parameter on typed settings."""
    mixed = bool(opts.fp16 or opts.bf16)
    fp32_grads = bool(opts.bf16 or opts.accumulate_allreduce_grads_in_fp32)
    state = 4 if opts.optimizer == "sgd" else 8
    if not mixed:
        replicated, sharded = 4 + 4, state
    elif fp32_grads:
        replicated, sharded = 2 + 4, 4 + state
    else:
        replicated, sharded = 2 + 2, 4 + 4 + state
    if opts.use_distributed_optimizer:
        return replicated + sharded / opts.data_parallel_size
    return float(replicated + sharded)


def compute_weight_and_optimizer_memory(args: argparse.Namespace) -> float:
    """Bytes of weights, gradients and optimizer state on the most loaded rank."""
    opts, config = _settings(args)
    return parameter_counts(opts, config).most_loaded_shard * parameter_bytes(opts)


def _layer_activation_bytes(opts: MemorySettings, config: TransformerConfig, e: int, selective: bool) -> float:
    cp = opts.context_parallel_size
    s, b, h = opts.seq_length // cp, opts.micro_batch_size, config.hidden_size
    f = config.ffn_hidden_size
    if config.gated_linear_unit:
        f = 2 * f  # two first-projection outputs kept (gate and value)
    a, t = config.num_attention_heads, opts.tensor_model_parallel_size
    q = config.kv_channels * a
    k = config.kv_channels * (config.num_query_groups or a)
    if config.multi_latent_attention:  # the heads' expanded q/k (d_qk + d_pe) and values (d_v); latents are small
        q = a * (config.qk_head_dim + config.qk_pos_emb_head_dim)
        k = (q + a * config.v_head_dim) / 2
    t_sp = t if opts.sequence_parallel else 1
    total = s * b * h * (4 * e + 2) / t_sp + e * s * b * (2 * q + 2 * k) / t + 2 * e * s * b * f / t
    if cp > 1:
        total += 8 * a * s * b / t  # ring attention keeps its fp32 softmax statistics, not the scores
    elif not selective:
        total += (2 * e + 1) * a * s * s * b / t
    return total


def compute_activation_memory(args: argparse.Namespace, num_microbatches: Optional[int] = None) -> Optional[float]:
    """Activation bytes on the first pipeline stage (see the module docstring); None where it does not apply."""
    return activation_memory(*_settings(args), num_microbatches)


def activation_memory(opts: MemorySettings, config: TransformerConfig,
                      num_microbatches: Optional[int] = None) -> Optional[float]:
    """compute_activation_memory on typed settings."""
    if opts.distribute_saved_activations:
        return None  # checkpointed inputs split over TP without SP: not modelled
    s, b, h = opts.seq_length // opts.context_parallel_size, opts.micro_batch_size, opts.hidden_size
    t, p = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size
    t_sp = t if opts.sequence_parallel else 1
    e = 2 if (opts.fp16 or opts.bf16) else 4
    granularity = opts.recompute_granularity
    layer = _layer_activation_bytes(opts, config, e, selective=granularity == "selective")
    layers = opts.num_layers // p
    recompute_peak = 0.0
    if granularity == "full":
        n = opts.recompute_num_layers or 1
        checkpoint_input = e * s * b * h / t_sp
        if opts.recompute_method == "block":
            n = min(n, layers)
            per_microbatch = n * checkpoint_input + (layers - n) * layer
            # The first n layers are recomputed after the later layers' activations are freed.
            recompute_peak = layer if n == layers else 0.0
        else:
            per_microbatch = -(-layers // n) * checkpoint_input
            recompute_peak = min(n, layers) * layer
    else:
        per_microbatch = layers * layer
    per_microbatch += 8 * s * b * 2 + s * b * h / t_sp  # token ids and positions (int64), embedding dropout mask
    bert = opts.model_family == "bert"
    binary = bert and opts.bert_binary_head
    if bert:  # int64 padding mask, bool [b, 1, s, s] attention mask, int64 token types with the binary head
        per_microbatch += 8 * s * b + s * s * b + (8 * s * b if binary else 0)
    in_flight = float(p)
    vp = opts.virtual_pipeline_model_parallel_size
    if p > 1 and vp is not None:
        in_flight *= 1 + (p - 1) / (p * vp)
    elif p > 1 and num_microbatches is not None:
        in_flight = float(min(p, num_microbatches))
    total = per_microbatch * in_flight + recompute_peak
    if p == 1:
        total += e * s * b * h + 4 * s * b * opts.padded_vocab_size / t  # output layer input, fp32 logits
        if bert:  # LM head dense, GeLU and LayerNorm inputs; pooler dense input, tanh output, fp32 SOP logits
            total += 3 * e * s * b * h / t_sp + ((2 * e * b * h + 4 * 2 * b) if binary else 0)
    return total


def report_theoretical_memory(args: argparse.Namespace, num_microbatches: Optional[int] = None,
                              verbose: bool = True) -> str:
    """Print (and return) Megatron's start-up lines: parameter counts and the memory footprint in MB."""
    return memory_report(*_settings(args), num_microbatches, verbose)


def memory_report(opts: MemorySettings, config: TransformerConfig, num_microbatches: Optional[int] = None,
                  verbose: bool = True) -> str:
    """report_theoretical_memory on typed settings."""
    counts = parameter_counts(opts, config)
    weight_and_optimizer = counts.most_loaded_shard * parameter_bytes(opts) / MB
    activation = activation_memory(opts, config, num_microbatches)
    etp = opts.expert_tensor_parallel_size or opts.tensor_model_parallel_size
    lines = []
    if verbose:
        lines += [
            f"Number of parameters in transformer layers in billions: {counts.transformer_layers / 1e9:.4f} "
            f"({counts.transformer_layers})",
            f"Number of parameters in embedding layers in billions: {counts.embedding_layers / 1e9:.4f} "
            f"({counts.embedding_layers})",
            *([f"Number of parameters in mtp block in billions: {counts.mtp / 1e9:.4f} ({counts.mtp})"]
              if counts.mtp else []),
            f"Total number of parameters in billions: {counts.total / 1e9:.4f} ({counts.total})",
            *([f"Number of parameters in routed experts in billions: {counts.experts / 1e9:.4f} ({counts.experts}), "
               f"{counts.experts // (opts.expert_model_parallel_size * etp)} per rank over expert-parallel size "
               f"{opts.expert_model_parallel_size} x expert-tensor-parallel size {etp}",
               f"Total number of active parameters in billions: {counts.active / 1e9:.4f} ({counts.active}), "
               f"top-{config.moe_router_topk} of {config.num_moe_experts} experts per token"] if counts.experts else []),
            f"Number of parameters in most loaded shard in billions: {counts.most_loaded_shard / 1e9:.4f} "
            f"({counts.most_loaded_shard})",
            f"Bytes per parameter (weights, grads, optimizer state): {parameter_bytes(opts):g}",
        ]
    if activation is None:
        lines.append(f"Theoretical memory footprints: weight and optimizer={weight_and_optimizer:.2f} MB, "
                     "activation=n/a")
    else:
        activation /= MB
        lines.append(f"Theoretical memory footprints: weight and optimizer={weight_and_optimizer:.2f} MB, "
                     f"activation={activation:.2f} MB, total={weight_and_optimizer + activation:.2f} MB")
    text = "\n".join(lines)
    print(text, flush=True)
    return text
