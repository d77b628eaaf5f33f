"""Multi-latent attention (MLA; DeepSeek-V2/V3) as Megatron Core 0.16 defines it (MLASelfAttention, local spec).

Per token: the query goes through a low-rank latent (``linear_q_down_proj`` [q_lora_rank, h], ``q_layernorm``,
``linear_q_up_proj`` [n * (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank]) or, without --q-lora-rank, one
``linear_q_proj``; keys and values come from one latent (``linear_kv_down_proj`` [kv_lora_rank + qk_pos_emb_head_dim,
h]: the latent and a rope key shared by every head; ``kv_layernorm``; ``linear_kv_up_proj``
[n * (qk_head_dim + v_head_dim), kv_lora_rank]). Each head's query/key is [no-position part; RoPE part]: RoPE rotates
only the last qk_pos_emb_head_dim channels (decoupled RoPE), after Megatron's MLA de-interleave (even channels, then
odd). The RoPE is YaRN's (--rope-type yarn, or no --rope-type: Megatron-LM's MLA default; cos/sin times its
concentration) or plain (--rope-type rope); softmax scale = mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim),
mscale = yarn_get_mscale(--rotary-scaling-factor, --mscale-all-dim) (1 without scaling). The
q/kv norms exist with config.qk_layernorm, as Megatron Core's local spec builds them.

Tensor parallelism splits the up projections over heads (ColumnParallelLinear) and the output projection
(``linear_proj``) as RowParallelLinear; the down projections are replicated on every rank (as
Megatron's Transformer Engine spec keeps them, "duplicated"). Under sequence parallelism they run on this rank's
sequence chunk and their weights (and the latent norms') carry `sequence_parallel`, so training sums their grads over
TP; the rope key is gathered over the sequence. Without it the rope key enters the heads through
copy_to_tensor_model_parallel_region, so every rank's down-projection gradient is the full one.

KV cache (megatron/layers/inference_params.py): each layer caches what MLA makes small, the normed latent
[S, B, kv_lora_rank] and the rotated rope key [S, B, qk_pos_emb_head_dim] (not n * (qk_head_dim + v_head_dim) K/V per
token). The first forward (the prompt) runs the training path on its tokens; later steps absorb the up projection:
q_nope . W_uk gives a query in latent space, scores are q_lat . latent + q_pe . k_pe, the context is averaged in latent
space and W_uv maps it to the heads' values. That costs O(S * n * (kv_lora_rank + rope dim)) per step, against
re-expanding the whole cache each step (O(S * kv_lora_rank * n * (qk_head_dim + v_head_dim)) and a full K/V copy).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.attention import model_parallel_rng_fork
from megatron.layers.inference_params import InferenceParams
from megatron.layers.module import MegatronModule
from megatron.layers.norms import build_norm
from megatron.layers.paged_kv import PagedStep, paged_attention
from megatron.layers.rotary import RotaryEmbedding, apply_rotary_pos_emb, yarn_scaling_of, yarn_softmax_scale
from megatron.layers.utils import group_size


class ReplicatedLinear(torch.nn.Module):
    """y = x W^T with the whole W on every tensor-parallel rank (MLA's down projections). Initialised from the
    full fp32 master, drawn like a ColumnParallelLinear's, so any TP size gets the TP=1 weights."""

    def __init__(self, input_size: int, output_size: int, config: TransformerConfig, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization and self.weight.device.type != "meta":
            master = torch.empty(output_size, input_size, dtype=torch.float32)
            config.init_method(master)
            with torch.no_grad():
                self.weight.copy_(master.to(config.params_dtype))
        self.weight.sequence_parallel = sequence_parallel  # training sums its grad over TP (partial per chunk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def rope_mla(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron Core's MLA RoPE on t [s, b, heads, d]: the rotated channels (cos' last dim) de-interleaved (even then
    odd), then the half-split rotation; channels past them pass through."""
    d = cos.size(-1)
    rot = torch.cat((t[..., 0:d:2], t[..., 1:d:2]), dim=-1)
    rot = apply_rotary_pos_emb(rot, cos, sin)
    return rot if d == t.size(-1) else torch.cat((rot, t[..., d:]), dim=-1)


class MLASelfAttention(MegatronModule):
    """Multi-latent self-attention, causal (see the module docstring); forward returns (output, bias) like
    ParallelAttention."""

    def __init__(self, config: TransformerConfig, layer_number: int, tp_group: Optional[Any] = None) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.tp_group = tp_group
        tp = group_size(tp_group)
        n = config.num_attention_heads
        self.heads = tensor_parallel.divide(n, tp)
        self.qk_dim, self.pe_dim, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.q_head_dim = self.qk_dim + self.pe_dim
        self.sequence_parallel = config.sequence_parallel and tp > 1
        self.softmax_scale = yarn_softmax_scale(config, self.q_head_dim)
        yarn = yarn_scaling_of(config) is not None  # YaRN rotates all pe channels; plain RoPE --rotary-percent of them
        self.rotary = RotaryEmbedding.from_config(config, self.pe_dim if yarn else int(self.pe_dim * config.rotary_percent))
        self.attention_dropout = config.attention_dropout
        self.checkpoint_core_attention = config.recompute_granularity == "selective"
        column = dict(config=config, init_method=config.init_method, tp_group=tp_group, bias=False,
                      gather_output=False, sequence_parallel=config.sequence_parallel)
        h = config.hidden_size
        if config.q_lora_rank is None:
            self.linear_q_proj = tensor_parallel.ColumnParallelLinear(h, n * self.q_head_dim, **column)
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, config.q_lora_rank, config, self.sequence_parallel)
            self.linear_q_up_proj = tensor_parallel.ColumnParallelLinear(config.q_lora_rank, n * self.q_head_dim,
                                                                         **column)
        self.linear_kv_down_proj = ReplicatedLinear(h, self.kv_rank + self.pe_dim, config, self.sequence_parallel)
        self.linear_kv_up_proj = tensor_parallel.ColumnParallelLinear(self.kv_rank, n * (self.qk_dim + self.v_dim),
                                                                      **column)
        if config.qk_layernorm:
            if config.q_lora_rank is not None:
                self.q_layernorm = build_norm(config, config.q_lora_rank)
            self.kv_layernorm = build_norm(config, self.kv_rank)
        self.linear_proj = tensor_parallel.RowParallelLinear(
            n * self.v_dim, h, config=config, init_method=config.output_layer_init_method, tp_group=tp_group,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            sequence_parallel=config.sequence_parallel)

    def set_context_parallel(self, cp_group: Any) -> None:
        """Refused: the context-parallel attention path takes one head dimension for q/k and v."""
        raise ValueError("--multi-latent-attention runs at --context-parallel-size 1 (its q/k and v head dims "
                         "differ); split long sequences with tensor/sequence parallelism instead")

    def _latents(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query input: the normed q latent or the hidden states, the normed kv latent, the rope key [s, b, pe]) on
        this rank's tokens (a sequence chunk under SP)."""
        if self.config.q_lora_rank is None:
            q_in = hidden_states
        else:
            q_in = self.linear_q_down_proj(hidden_states)
            if hasattr(self, "q_layernorm"):
                q_in = self.q_layernorm(q_in)
        latent, k_pe = torch.split(self.linear_kv_down_proj(hidden_states), [self.kv_rank, self.pe_dim], dim=-1)
        if hasattr(self, "kv_layernorm"):
            latent = self.kv_layernorm(latent)
        return q_in, latent, k_pe

    def _query(self, q_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q without position [s, b, heads, qk], the rotated q part [s, b, heads, pe]) of this rank's heads."""
        proj = self.linear_q_proj if self.config.q_lora_rank is None else self.linear_q_up_proj
        q, _ = proj(q_in)
        q = q.view(q.size(0), q.size(1), self.heads, self.q_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_dim, self.pe_dim], dim=-1)
        return q_nope, rope_mla(q_pe, cos, sin)

    def _rope_key(self, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rope key of the whole sequence [s, b, 1, pe], rotated; its gradient summed over TP."""
        if self.sequence_parallel:
            k_pe = tensor_parallel.gather_from_sequence_parallel_region(k_pe, self.tp_group)
        elif self.tp_group is not None and group_size(self.tp_group) > 1:
            k_pe = tensor_parallel.copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        return rope_mla(k_pe.unsqueeze(2), cos, sin)

    def _up_project(self, q_in, latent, k_pe, offset: int, packed: Optional[PackedSeqParams] = None):
        seq = latent.size(0) * (group_size(self.tp_group) if self.sequence_parallel else 1)
        if packed is None:
            cos, sin = self.rotary.cos_sin(seq, offset, latent.device, latent.dtype)
        else:  # packed documents: each at its positions inside its document
            cos, sin = self.rotary.cos_sin_at(packed.position_ids(latent.size(1), seq, latent.device), latent.dtype)
        q_nope, q_pe = self._query(q_in, cos, sin)
        kv, _ = self.linear_kv_up_proj(latent)
        kv = kv.view(kv.size(0), kv.size(1), self.heads, self.qk_dim + self.v_dim)
        k_nope, value = torch.split(kv, [self.qk_dim, self.v_dim], dim=-1)
        k_pe = self._rope_key(k_pe, cos, sin)
        query = torch.cat((q_nope, q_pe), dim=-1)
        key = torch.cat((k_nope, k_pe.expand(-1, -1, self.heads, -1)), dim=-1)
        return query, key, value.contiguous()

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                encoder_output: Optional[torch.Tensor] = None,
                inference_params: Optional[InferenceParams] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden [s(/TP under SP), b, h], mask bool [b|1, 1, sq, sk] (True = masked) or None (causal) ->
        (output [s(/TP), b, h], output bias or None). `packed_seq_params`: packed documents (their positions and
        block-diagonal causal mask replace `attention_mask`)."""
        if encoder_output is not None:
            raise ValueError("multi-latent attention is self-attention only (no encoder output)")
        q_in, latent, k_pe = self._latents(hidden_states)
        if isinstance(inference_params, PagedStep):  # the inference engine's paged latent cache
            return self.linear_proj(self._paged_forward(q_in, latent, k_pe, inference_params))
        if inference_params is not None:
            if packed_seq_params is not None:
                raise ValueError("packed sequences (cu_seqlens) are for training and evaluation, not KV-cache decoding")
            context = self._cached_forward(q_in, latent, k_pe, attention_mask, inference_params)
            return self.linear_proj(context)
        query, key, value = self._up_project(q_in, latent, k_pe, 0, packed_seq_params)
        if packed_seq_params is not None:
            attention_mask = packed_seq_params.attention_mask(query.size(1), query.size(0), query.device)
        if self.checkpoint_core_attention and self.training and torch.is_grad_enabled():
            context = tensor_parallel.checkpoint(self._core_attention, False, query, key, value, attention_mask)
        else:
            context = self._core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax(q k^T * scale + mask) v for q/k [s, b, heads, qk + pe], v [s, b, heads, v] -> [s, b, heads * v].
        SDPA without attention dropout; with it the explicit path, dropout under the model-parallel RNG."""
        sq, b = q.size(0), q.size(1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        dropout = self.training and self.attention_dropout > 0.0
        if not dropout:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else ~mask,
                                                 is_causal=mask is None, scale=self.softmax_scale)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
            if mask is None:
                mask = torch.ones(sq, k.size(2), dtype=torch.bool, device=q.device).triu(1)
            probs = torch.softmax(scores.float().masked_fill(mask, float("-inf")), dim=-1).to(v.dtype)
            with model_parallel_rng_fork(not self.sequence_parallel):
                probs = F.dropout(probs, p=self.attention_dropout, training=True)
            ctx = torch.matmul(probs, v)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.v_dim)

    def _update_cache(self, latent: torch.Tensor, k_pe: torch.Tensor,
                      params: InferenceParams) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Write this step's latent and rotated rope key into the layer's cache; (latents, rope keys of positions
        0..s1-1, s0, s1)."""
        cache = params.key_value_memory_dict
        if self.layer_number not in cache:
            shape = (params.max_sequence_length, params.max_batch_size)
            cache[self.layer_number] = (latent.new_empty(shape + (self.kv_rank,)),
                                        k_pe.new_empty(shape + (self.pe_dim,)))
        latents, keys = cache[self.layer_number]
        b0, s0 = params.batch_size_offset, params.sequence_len_offset
        b1, s1 = b0 + latent.size(1), s0 + latent.size(0)
        if s1 > latents.size(0) or b1 > latents.size(1):
            raise ValueError(f"inference cache too small: need sequence {s1} / batch {b1}, allocated "
                             f"{latents.size(0)} / {latents.size(1)} (InferenceParams(max_batch_size, "
                             "max_sequence_length))")
        latents[s0:s1, b0:b1] = latent
        keys[s0:s1, b0:b1] = k_pe
        return latents[:s1, b0:b1], keys[:s1, b0:b1], s0, s1

    def _cached_forward(self, q_in: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                        mask: Optional[torch.Tensor], params: InferenceParams) -> torch.Tensor:
        """Decoding with the latent cache: the prompt through the training path, later steps absorbed."""
        s0 = params.sequence_len_offset
        cos, sin = self.rotary.cos_sin(latent.size(0), s0, latent.device, latent.dtype)
        k_pe_rot = rope_mla(k_pe.unsqueeze(2), cos, sin).squeeze(2)
        latents, keys, s0, s1 = self._update_cache(latent, k_pe_rot, params)
        if mask is not None and mask.size(-2) != latent.size(0):
            mask = mask[..., s0:s1, :s1]
        if s0 == 0:
            query, key, value = self._up_project(q_in, latent, k_pe, 0)
            return self._core_attention(query, key, value, mask)
        q_nope, q_pe = self._query(q_in, cos, sin)
        w = self.linear_kv_up_proj.weight.view(self.heads, self.qk_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w[:, :self.qk_dim], w[:, self.qk_dim:]
        q_lat = torch.einsum("sbnd,ndr->sbnr", q_nope, w_uk)
        scores = (torch.einsum("sbnr,tbr->bnst", q_lat, latents)
                  + torch.einsum("sbnd,tbd->bnst", q_pe, keys)) * self.softmax_scale
        if mask is None:
            mask = torch.ones(s1 - s0, s1, dtype=torch.bool, device=scores.device).triu(s0 + 1)
        probs = torch.softmax(scores.float().masked_fill(mask, float("-inf")), dim=-1).to(latents.dtype)
        ctx = torch.einsum("nvr,sbnr->sbnv", w_uv, torch.einsum("bnst,tbr->sbnr", probs, latents))
        return ctx.reshape(ctx.size(0), ctx.size(1), self.heads * self.v_dim)

    def _paged_forward(self, q_in: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                       step: PagedStep) -> torch.Tensor:
        """One engine step (tokens [T, 1, ...]) over the paged cache of latents and rotated rope keys, every query
        absorbed into latent space (as the cached decoding steps): -> context [T, 1, heads * v]."""
        cos, sin = step.rotary_cos_sin(self.rotary, latent.dtype)
        k_pe_rot = rope_mla(k_pe.unsqueeze(2), cos, sin)[:, 0, 0]  # [T, pe]
        latents, keys = step.write(self.layer_number, latent[:, 0], k_pe_rot)
        q_nope, q_pe = self._query(q_in, cos, sin)  # [T, 1, heads, qk], [T, 1, heads, pe]
        w = self.linear_kv_up_proj.weight.view(self.heads, self.qk_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w[:, :self.qk_dim], w[:, self.qk_dim:]
        q_lat = torch.einsum("tnd,ndr->tnr", q_nope[:, 0], w_uk)
        query = torch.cat((q_lat, q_pe[:, 0]), dim=-1)  # [T, heads, r + pe]: one dot product with [latent; rope key]
        key = torch.cat((step.gather(latents), step.gather(keys)), dim=-1).unsqueeze(2)  # [R, L, 1, r + pe]
        ctx_lat = paged_attention(step.pad_queries(query), key, step.gather(latents).unsqueeze(2),
                                  step.attend_mask(), self.softmax_scale)  # [R, Q, heads, r]
        ctx = torch.einsum("nvr,tnr->tnv", w_uv, step.unpad(ctx_lat).to(latent.dtype))
        return ctx.reshape(ctx.size(0), 1, self.heads * self.v_dim)
