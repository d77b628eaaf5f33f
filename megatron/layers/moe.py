"""Mixture-of-experts MLP (Megatron-LM core's MoELayer numerics): router, batched experts, shared expert.

Flow of `MoELayer.forward(hidden [s, b, h])`:
  shared expert (optional, every token)  +  router -> (probs, routing map) -> permute tokens by expert ->
  experts as batched GEMMs over groups padded to their run's largest (`expert_buckets`; or to the capacity) ->
  unpermute (sum back to token order; routing weights are applied to the activation, as Megatron-LM does).
  The permutations are gathers forward and backward (megatron/layers/moe_permute.py), equal to index_select/index_add.
Under tensor parallelism (which needs sequence parallelism, as in Megatron-LM) the tokens of the TP group are
all-gathered before the experts, every rank computes its slice of each expert's inner dimension, and the result is
reduce-scattered back to the sequence split (Megatron-LM's allgather dispatcher with expert-TP = TP). At inference
sequence parallelism is off (megatron.core.utils.sequence_parallel_off): the TP ranks hold the same tokens, so there
is no gather and the experts' partial sums are all-reduced.
With --expert-tensor-parallel-size different from TP (`etp_group`, Megatron-LM core's expert-tensor-parallel group)
the experts' inner dimension is split over `etp_group` instead, and the tokens are gathered / reduce-scattered over
it (ETP = 1 under TP = 2: each rank runs whole experts on its own sequence slice); router, aux losses and the shared
expert stay on the dense TP group.

Expert parallelism (`ep_group` of size EP, expert-TP = TP): each rank holds experts [ep_rank * L, (ep_rank + 1) * L)
with L = num_experts / EP. The tokens (after the TP gather) reach them by either dispatcher:
  allgather: all-gather tokens, probs and routing map over the EP group, compute the local experts on all of them,
             reduce-scatter the partial outputs back (every token's contributions summed over the EP ranks);
  alltoall:  permute by (global) expert, all-to-all the rows with per-rank counts, compute the local experts on the
             rows received, reverse all-to-all, unpermute (megatron/core/expert_parallel.py; autograd reverses both).
Router, capacity and aux losses work on each rank's own tokens, as without EP (EP ranks are data-parallel ranks).
Expert parameters carry ``allreduce = False`` (Megatron's mark): their grads are reduced over the
expert-data-parallel group.

Routing (`TopKRouter`): logits = x W^T (fp32/fp64 with moe_router_dtype); z-loss; top-k (optionally group-limited,
and with sigmoid scores optionally chosen by score + `expert_bias`, updated after each iteration) then softmax over the k
(or softmax/sigmoid before top-k with moe_router_pre_softmax / the sigmoid score function); optional scaling factor;
capacity dropping (probs | position, optional pad to capacity); load-balancing loss from the softmax over all
experts. Auxiliary losses enter backward through megatron.core.aux_losses.AuxLossAutoScaler; their values are recorded
per layer under Megatron-LM's log names, which a model declares with `router_losses` (the loop logs what is declared).

With --add-bias-linear (GPT-OSS; Megatron-LM core's TopKRouter and TEGroupedMLP): the router's logits get a bias
``mlp.router.bias`` [E], the experts ``mlp.experts.bias1`` [E, (2)F] (after the first GEMM) and ``bias2`` [E, h]
(added times the routing weight, as Megatron's grouped MLP does: (act W2 + b2) * weight).

Parameter names: ``mlp.router.weight`` [E, h]; ``mlp.experts.weight1`` [E, h, F (x2 gated: [gate | up] per TP
rank)], ``mlp.experts.weight2`` [E, F, h] (per-expert matrices stacked, input-major, as Megatron's GroupedMLP
views them); ``mlp.shared_experts.dense_h_to_4h`` / ``dense_4h_to_h`` (+ ``gate_weight`` [1, h]).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core import aux_losses, expert_parallel, tensor_parallel
from megatron.core.transformer_config import TransformerConfig
from megatron.layers import moe_permute, moe_swiglu_experts
from megatron.layers.mlp import ParallelMLP, activation_for
from megatron.layers.module import MegatronModule
from megatron.layers.utils import group_rank, group_size

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}
SAME_AS_TP = "tp"  # MoELayer's default expert-tensor-parallel group: the dense TP group (Megatron-LM's default)
# --moe-router-load-balancing-type -> the log name of its loss (Megatron-LM's)
LOAD_BALANCING_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def recorded_layers(config: TransformerConfig) -> int:
    """Layers a router may record from: the decoder's and the multi-token-prediction depths' (numbered after it,
    megatron/layers/mtp.py), as Megatron-LM counts them."""
    return config.num_layers + (config.mtp_num_layers or 0)


def router_losses(config: TransformerConfig, tp_group: Optional[Any]) -> Tuple[aux_losses.AuxLoss, ...]:
    """The named losses the routers of a model of `config` record, as the model declares them (Megatron-LM's log
    names and order): the load-balancing loss (summed over `tp_group`, averaged over data-parallel ranks) and the
    z-loss, each averaged over the MoE layers; none without experts. With --moe-per-layer-logging each also gives
    TensorBoard's moe/<name>_layer_<i>."""
    if config.num_moe_experts is None:
        return ()
    num_moe = sum(config.moe_layer_pattern) + (config.mtp_num_layers or 0)  # Megatron-LM adds the MTP depths

    def loss(name: str, dp_average: bool, group: Optional[Any]) -> aux_losses.AuxLoss:
        per_layer = f"moe/{name}" if config.moe_per_layer_logging else None
        return aux_losses.AuxLoss(name, recorded_layers(config), num_moe, dp_average, group, per_layer)

    declared = []
    kind = config.moe_router_load_balancing_type
    if kind in LOAD_BALANCING_LOSS_NAMES and config.moe_aux_loss_coeff:
        declared.append(loss(LOAD_BALANCING_LOSS_NAMES[kind], True, tp_group))
    if config.moe_z_loss_coeff is not None:
        declared.append(loss("z_loss", False, None))
    return tuple(declared)


def capacity_of(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Megatron's expert capacity: ceil(tokens * topk / experts * factor)."""
    return math.ceil((num_tokens * topk / num_experts) * factor)


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """Sinkhorn normalisation of exp(cost) (S-BASE routing), Megatron's iteration and tolerance."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-LM core's group-limited top-k: the experts split into `num_groups` equal groups, each group scored by
    the sum of its top-(topk // group_topk) scores, the `group_topk` best groups kept and the top-k experts chosen
    among theirs. Returns (values, indices) [T, topk] as torch.topk."""
    num_tokens, num_experts = scores.shape
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
    masked = scores.masked_fill(~score_mask.reshape(num_tokens, -1).bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, pre_softmax: bool, score_function: str,
                 scaling_factor: Optional[float], num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                 expert_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E] zero outside the chosen experts, routing map [T, E] bool) from logits [T, E] (Megatron-LM core's
    topk_routing_with_score_function). With `group_topk` the choice is group-limited (`group_limited_topk`); with
    `expert_bias` (sigmoid only) the experts are chosen by score + bias while the weights stay the scores."""
    def choose(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, idx = choose(scores)
        else:
            top, idx = choose(logits)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    else:  # sigmoid
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, idx = choose(scores + expert_bias)
            probs = torch.gather(scores, dim=1, index=idx).type_as(logits)
        else:
            probs, idx = choose(scores)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return routing_probs, routing_map


def drop_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, factor: float, policy: str,
                       pad_to_capacity: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most `capacity` tokens per expert (highest probs, or earliest positions); Megatron's rule."""
    num_tokens, num_experts = probs.shape
    capacity = capacity_of(num_tokens, num_experts, topk, factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        ranking = probs if policy == "probs" else routing_map.int()
        _, rows = torch.topk(ranking, k=capacity, dim=0, sorted=False)
        keep = torch.zeros_like(routing_map).scatter(0, rows, True)
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


class TopKRouter(MegatronModule):
    """Megatron-LM core's TopKRouter: ``weight`` [num_experts, hidden] (replicated over TP)."""

    def __init__(self, config: TransformerConfig, layer_number: Optional[int] = None,
                 tp_group: Optional[Any] = None) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.tp_group = tp_group
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        weight = torch.empty(config.num_moe_experts, config.hidden_size, dtype=torch.float32)
        if config.perform_initialization:
            config.init_method(weight)
        self.weight = torch.nn.Parameter(weight.to(config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel  # grads summed over TP under SP
        self.bias = None
        if config.add_bias_linear:  # Megatron-LM core: the router has a bias with --add-bias-linear (GPT-OSS)
            bias = torch.empty(config.num_moe_experts, dtype=torch.float32)
            if config.perform_initialization:
                config.init_method(bias)
            self.bias = torch.nn.Parameter(bias.to(config.params_dtype))
            self.bias.sequence_parallel = config.sequence_parallel
        # aux-loss-free balancing: the bias fp32 and saved, the counts not saved (None without it, as Megatron-LM)
        on = config.moe_router_enable_expert_bias
        self.register_buffer("local_tokens_per_expert", torch.zeros(self.num_experts) if on else None,
                             persistent=False)
        self.register_buffer("expert_bias", torch.zeros(self.num_experts) if on else None)

    def _keep_fp32_expert_bias(self) -> None:
        """The bias and counts stay fp32 under a bf16/fp16 wrapper (Megatron-LM core's
        _maintain_float32_expert_bias): a low-precision bias would route differently after updates."""
        for name in ("expert_bias", "local_tokens_per_expert"):
            buf = getattr(self, name)
            if buf is not None and buf.dtype != torch.float32:
                buf.data = buf.data.float()

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._keep_fp32_expert_bias()
        super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._keep_fp32_expert_bias()
        super()._save_to_state_dict(*args, **kwargs)

    def step_counts(self) -> Optional[torch.Tensor]:
        """Tokens this rank routed to each expert since the last update (fp32 [E]); None without the expert bias
        (the declaration megatron/core/step_updates.py looks for)."""
        if self.expert_bias is None:
            return None
        self._keep_fp32_expert_bias()
        return self.local_tokens_per_expert

    def apply_step_update(self, global_counts: torch.Tensor) -> None:
        """Megatron-LM core's get_updated_expert_bias from the counts summed over TP x CP x DP:
        bias += rate * sign(mean(counts) - counts); the local counts restart from zero."""
        with torch.no_grad():
            mean = global_counts.sum(dim=-1, keepdim=True) / global_counts.shape[-1]
            self.expert_bias.copy_(self.expert_bias + torch.sign(mean - global_counts)
                                   * self.config.moe_router_bias_update_rate)
            self.local_tokens_per_expert.zero_()

    def _aux_losses_active(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _ROUTER_DTYPES[self.config.moe_router_dtype] or x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)

    def apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not self._aux_losses_active():
            return logits
        coeff = coeff / group_size(self.tp_group)
        z_loss = torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff
        aux_losses.record("z_loss", z_loss / coeff, self.layer_number, recorded_layers(self.config))
        return aux_losses.AuxLossAutoScaler.apply(logits, z_loss)

    def _load_balancing(self, probs: torch.Tensor, logits: torch.Tensor, seq_length: int, bsz: int) -> torch.Tensor:
        kind, coeff = self.config.moe_router_load_balancing_type, self.config.moe_aux_loss_coeff
        if kind not in LOAD_BALANCING_LOSS_NAMES or not coeff or not self._aux_losses_active():
            return probs
        if self.config.moe_router_score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits)
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        _, idx = torch.topk(scores, k=self.topk, dim=1)
        chosen = torch.zeros_like(scores).scatter(1, idx, 1.0)
        divisor = 1
        if kind == "seq_aux_loss":  # each sequence of the batch is its own group of tokens
            scores, chosen, divisor = scores.reshape(seq_length, -1), chosen.reshape(seq_length, -1), bsz
        tokens_per_expert = tensor_parallel.reduce_from_tensor_model_parallel_region(chosen.sum(dim=0), self.tp_group)
        total = scores.shape[0] * group_size(self.tp_group)
        aux = torch.sum(scores.sum(dim=0) * tokens_per_expert) * (
            self.num_experts * coeff / (self.topk * total * total)) / divisor
        aux_losses.record(LOAD_BALANCING_LOSS_NAMES[kind], aux / coeff, self.layer_number, recorded_layers(self.config))
        return aux_losses.AuxLossAutoScaler.apply(probs, aux)

    def forward(self, x: torch.Tensor, seq_length: int, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] -> (probs [T, E], routing map [T, E] bool)."""
        cfg = self.config
        self._keep_fp32_expert_bias()
        logits = self.apply_z_loss(self.gating(x))
        if cfg.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map = self._sinkhorn(logits)
        else:
            probs, routing_map = topk_routing(logits, self.topk, cfg.moe_router_pre_softmax,
                                              cfg.moe_router_score_function, cfg.moe_router_topk_scaling_factor,
                                              cfg.moe_router_num_groups, cfg.moe_router_group_topk, self.expert_bias)
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_over_capacity(probs, routing_map, self.topk, cfg.moe_expert_capacity_factor,
                                                    cfg.moe_token_drop_policy, cfg.moe_pad_expert_input_to_capacity)
        probs = self._load_balancing(probs, logits, seq_length, bsz)
        if self.expert_bias is not None and torch.is_grad_enabled():  # training forwards only, as Megatron-LM
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def _sinkhorn(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def activation(x: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(x) if self.topk == 1 else torch.softmax(x, dim=-1, dtype=torch.float32).type_as(x)

        if self.training:
            with torch.no_grad():
                _, idx = torch.topk(sinkhorn(logits.float()), k=self.topk, dim=1)
            scores = activation(logits)
        else:
            scores = activation(logits)
            _, idx = torch.topk(scores, k=self.topk, dim=1)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
        return scores * routing_map, routing_map


class GroupedExperts(MegatronModule):
    """All experts of the layer as stacked weights, computed with one batched matmul per projection."""

    def __init__(self, config: TransformerConfig, tp_group: Optional[Any] = None,
                 ep_group: Optional[Any] = None, expert_tp_differs: bool = False) -> None:
        """`tp_group`: the group the experts' inner dimension is split over (the expert-tensor-parallel group;
        `expert_tp_differs` when it is not the dense TP group)."""
        super().__init__(config=config)
        ep, ep_rank = group_size(ep_group), group_rank(ep_group)
        if config.num_moe_experts % ep:
            raise ValueError(f"--num-experts ({config.num_moe_experts}) must be divisible by "
                             f"--expert-model-parallel-size ({ep})")
        self.num_experts = config.num_moe_experts // ep  # this rank's (local) experts
        local = slice(ep_rank * self.num_experts, (ep_rank + 1) * self.num_experts)
        tp, rank = group_size(tp_group), group_rank(tp_group)
        ffn = config.moe_ffn_hidden_size
        if ffn % tp:
            flag = "expert-tensor-parallel-size" if expert_tp_differs else "tensor-model-parallel-size"
            raise ValueError(f"--moe-ffn-hidden-size ({ffn}) must be divisible by --{flag} ({tp})")
        self.gated = config.gated_linear_unit
        self.activation_name, self.activation_func = activation_for(config)
        blocks = 2 if self.gated else 1
        e, h = config.num_moe_experts, config.hidden_size
        # Full (TP=1, EP=1) weights from the global seed, then this rank's slice: TP=N / EP=N equal TP=1 for a seed.
        w1 = torch.empty(e, blocks * ffn, h, dtype=torch.float32)  # Megatron's per-expert fc1 layout [2F, h]
        w2 = torch.empty(e, h, ffn, dtype=torch.float32)
        if config.perform_initialization:
            config.init_method(w1)
            config.output_layer_init_method(w2)
        w1, w2 = w1[local], w2[local]
        w1 = torch.cat([b.chunk(tp, dim=1)[rank] for b in w1.chunk(blocks, dim=1)], dim=1)
        w2 = w2.chunk(tp, dim=2)[rank]
        self.weight1 = torch.nn.Parameter(w1.transpose(1, 2).contiguous().to(config.params_dtype))
        self.weight2 = torch.nn.Parameter(w2.transpose(1, 2).contiguous().to(config.params_dtype))
        for param, dim, nblocks, what in ((self.weight1, 2, blocks, "[gate | up] per rank" if self.gated else ""),
                                          (self.weight2, 1, 1, "")):
            tensor_parallel.set_tensor_model_parallel_attributes(param, tp > 1 or not expert_tp_differs, dim, 1)
            tensor_parallel.set_tp_layout(param, tensor_parallel.TensorParallelLayout(dim=dim, blocks=nblocks,
                                                                                      structure=what))
            param.allreduce = False  # an expert parameter (Megatron's mark): reduced over expert-data-parallel
        self.tp_size = tp
        self.bias1 = self.bias2 = None
        if config.add_bias_linear:
            self._expert_biases(config, local, tp, rank, blocks, expert_tp_differs)

    def _expert_biases(self, config: TransformerConfig, local: slice, tp: int, rank: int, blocks: int,
                       expert_tp_differs: bool) -> None:
        """Megatron-LM core's expert biases with --add-bias-linear (GPT-OSS): ``bias1`` [E, (2)F] split over the
        expert-TP group like weight1's columns, ``bias2`` [E, h] whole on every expert-TP rank (each adds
        bias2 * weight / TP, the partial sums' reduction completes it; its grads are summed over TP like a
        sequence-parallel parameter's). Zero-initialised, as Megatron's linear biases."""
        if expert_tp_differs:
            raise ValueError("expert biases (--add-bias-linear with --num-experts) need --expert-tensor-parallel-size "
                             "equal to --tensor-model-parallel-size")
        e, ffn = config.num_moe_experts, config.moe_ffn_hidden_size
        b1 = torch.zeros(e, blocks * ffn, dtype=torch.float32)[local]
        b1 = torch.cat([b.chunk(tp, dim=1)[rank] for b in b1.chunk(blocks, dim=1)], dim=1)
        self.bias1 = torch.nn.Parameter(b1.contiguous().to(config.params_dtype))
        self.bias2 = torch.nn.Parameter(torch.zeros(e, config.hidden_size, dtype=config.params_dtype)[local].clone())
        tensor_parallel.set_tensor_model_parallel_attributes(self.bias1, True, 1, 1)
        tensor_parallel.set_tp_layout(self.bias1, tensor_parallel.TensorParallelLayout(
            dim=1, blocks=blocks, structure="[gate | up] per rank" if self.gated else ""))
        self.bias2.sequence_parallel = tp > 1
        for param in (self.bias1, self.bias2):
            param.allreduce = False

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor, expert_of_row: torch.Tensor,
                slot_of_row: torch.Tensor, slots: int) -> torch.Tensor:
        """tokens [N, h] grouped by expert, probs [N]; row i is slot `slot_of_row[i]` of its expert's group. `slots`
        is the group size to pad to (the largest group, or the capacity with --moe-pad-expert-input-to-capacity).

        Without capacity padding the experts are split into contiguous runs (`expert_buckets`), each a batched GEMM
        over groups padded to the run's largest, instead of one over all groups padded to the overall largest: the
        same numbers per row, less padding when the routing is unbalanced."""
        n = tokens.shape[0]
        buckets, flat, offset = self.layout(expert_of_row, slot_of_row, slots)
        with torch.no_grad():
            inverse = torch.full((offset,), n, dtype=torch.long)
            inverse[flat] = torch.arange(n)
            padded = offset > n
        grouped = moe_permute.dispatch(tokens, inverse, flat.view(-1, 1), padded, False)  # [offset, h]
        weights = probs.new_zeros(offset).index_copy(0, flat, probs)
        out = self.compute(grouped, weights, buckets)
        return moe_permute.combine(out, flat.view(-1, 1), inverse, False, padded)

    def forward_tokens(self, x: torch.Tensor, probs: torch.Tensor, token_of_row: torch.Tensor,
                       expert_of_row: torch.Tensor, slot_of_row: torch.Tensor, slots: int,
                       probs_on_input: bool = False) -> torch.Tensor:
        """`forward` on the rows x[token_of_row] with the outputs summed back per token ([T, h]), each token read
        into its padded slots and summed back from them in one gather (no [rows, h] copy in between); the same
        numbers as `forward` between `moe_permute.dispatch` / `combine` over token_of_row."""
        num_tokens, n = x.shape[0], token_of_row.numel()
        buckets, flat, offset = self.layout(expert_of_row, slot_of_row, slots)
        with torch.no_grad():
            rows_of_token, uneven = moe_permute.inverse_table(token_of_row, num_tokens)  # [T, K] rows, n = none
            slots_of_token = torch.cat((flat, flat.new_full((1,), offset)))[rows_of_token]  # offset = none
            token_of_slot = torch.full((offset,), num_tokens, dtype=torch.long)  # num_tokens = padding
            token_of_slot[flat] = token_of_row
        grouped = moe_permute.dispatch(x, token_of_slot, slots_of_token, offset > n, uneven)  # [offset, h]
        weights = probs.new_zeros(offset).index_copy(0, flat, probs)
        if probs_on_input:  # Megatron's --moe-apply-probs-on-input: the rows scaled before the experts
            grouped = grouped * weights.unsqueeze(-1).to(grouped.dtype)
            weights = weights.new_zeros(offset).index_fill_(0, flat, 1.0)
        out = self.compute(grouped, weights, buckets)
        return moe_permute.combine(out, slots_of_token, token_of_slot, uneven, offset > n)

    def layout(self, expert_of_row: torch.Tensor, slot_of_row: torch.Tensor,
               slots: int) -> tuple[list, torch.Tensor, int]:
        """(runs of experts, each row's place in the padded groups, number of padded rows)."""
        e = self.num_experts
        with torch.no_grad():
            counts = torch.bincount(expert_of_row, minlength=e).tolist()
            buckets = ([(0, e, slots)] if slots > max(counts, default=0) else expert_buckets(counts))
            base = torch.empty(e, dtype=torch.long)
            offset = 0
            for first, num, size in buckets:
                base[first:first + num] = offset + size * torch.arange(num)
                offset += num * size
            return buckets, base[expert_of_row] + slot_of_row, offset

    def compute(self, grouped: torch.Tensor, weights: torch.Tensor, buckets: list) -> torch.Tensor:
        """The expert MLPs on padded groups [rows, h] laid out run by run (`buckets`), outputs times `weights`."""
        if self.activation_name == "swiglu" and self.bias1 is None and moe_swiglu_experts.applies(
                grouped, weights, self.weight1, self.weight2):
            return moe_swiglu_experts.swiglu_experts(grouped, weights, self.weight1, self.weight2, buckets)
        h = grouped.shape[-1]
        sizes = [num * size for _, num, size in buckets]
        if len(buckets) > 1:
            parts = zip(grouped.split(sizes), weights.split(sizes), self.weight1.split([b[1] for b in buckets]),
                        self.weight2.split([b[1] for b in buckets]), buckets)
        else:
            parts = [(grouped, weights, self.weight1, self.weight2, buckets[0])]
        outs = []
        for rows, w, w1, w2, (first, num, size) in parts:
            pre = torch.bmm(rows.view(num, size, h), w1)
            if self.bias1 is not None:
                pre = pre + self.bias1[first:first + num].unsqueeze(1)
            inner = self.activation_func(pre)  # gated: [gate | up] halves
            inner = (inner * w.view(num, size, 1)).to(grouped.dtype)
            out = torch.bmm(inner, w2)
            if self.bias2 is not None:  # Megatron: + bias2 * weight per row (this rank's share under expert-TP)
                bias2 = self.bias2[first:first + num].unsqueeze(1) * w.view(num, size, 1)
                out = out + (bias2 / self.tp_size if self.tp_size > 1 else bias2).to(out.dtype)
            outs.append(out.view(num * size, h))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def expert_buckets(counts: list[int], run_rows: int = 16, split_rows: int = 128) -> list[tuple[int, int, int]]:
    """Contiguous runs of experts (first, number, rows each) covering all experts that minimise the padded rows:
    the sum over runs of number x the run's largest count, plus `run_rows` per run (one more GEMM call); one run
    unless splitting saves more than `split_rows` (the weight gradients are then concatenated from the runs')."""
    e = len(counts)
    best, cut = [0] + [None] * e, [0] * (e + 1)
    for j in range(1, e + 1):
        largest = 0
        for i in range(j - 1, -1, -1):
            largest = max(largest, counts[i])
            cost = best[i] + (j - i) * largest + run_rows
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    if best[e] + split_rows >= e * max(counts, default=0) + run_rows:
        return [(0, e, max(counts, default=0))]
    runs, j = [], e
    while j > 0:
        i = cut[j]
        runs.append((i, j - i, max(counts[i:j])))
        j = i
    return runs[::-1]


class SharedExpertMLP(ParallelMLP):
    """The shared expert(s): a dense MLP of moe_shared_expert_intermediate_size, optionally gated by
    sigmoid(x . gate_weight) (Megatron-LM core's SharedExpertMLP)."""

    def __init__(self, config: TransformerConfig, tp_group: Optional[Any] = None) -> None:
        shared_config = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        super().__init__(shared_config, tp_group)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            gate = torch.empty(1, config.hidden_size, dtype=torch.float32)
            if config.perform_initialization:
                config.init_method(gate)
            self.gate_weight = torch.nn.Parameter(gate.to(config.params_dtype))
            self.gate_weight.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        out, bias = super().forward(hidden_states)
        if bias is not None:
            out = out + bias
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
        return out, None


class MoELayer(MegatronModule):
    """Router + experts (+ shared expert); returns (output [s(/tp), b, h], None) like ParallelMLP."""

    def __init__(self, config: TransformerConfig, layer_number: Optional[int] = None,
                 tp_group: Optional[Any] = None, ep_group: Optional[Any] = None,
                 dispatcher: str = "allgather", etp_group: Any = SAME_AS_TP) -> None:
        super().__init__(config=config)
        if dispatcher not in ("allgather", "alltoall"):
            raise ValueError(f"--moe-token-dispatcher-type {dispatcher} is not implemented; use allgather or alltoall")
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel
        self.router = TopKRouter(config, layer_number, tp_group)
        self.ep_group, self.dispatcher = ep_group, dispatcher
        self.ep_size, self.ep_rank = group_size(ep_group), group_rank(ep_group)
        differs = not (isinstance(etp_group, str) and etp_group == SAME_AS_TP)
        self.etp_group = etp_group if differs else tp_group  # experts split / tokens gathered over it
        self.experts = GroupedExperts(config, self.etp_group, ep_group, expert_tp_differs=differs)
        self.shared_experts = (SharedExpertMLP(config, tp_group)
                               if config.moe_shared_expert_intermediate_size else None)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens of the whole expert-TP group (sequence parallel): all-gather forward, reduce-scatter backward."""
        return tensor_parallel.gather_from_sequence_parallel_region(x, self.etp_group)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        shape = hidden_states.shape
        seq_length, bsz, h = shape
        x = hidden_states.reshape(-1, h)
        probs, routing_map = self.router(x, seq_length, bsz)
        split_experts = group_size(self.etp_group) > 1
        # Without SP (inference: megatron.core.utils.sequence_parallel_off) the TP ranks already hold the same
        # tokens: no gather, and the experts' partial sums are all-reduced instead of reduce-scattered.
        gather = split_experts and (self.sequence_parallel or self.etp_group is not self.tp_group)
        if gather:
            x, probs = self._gather(x), self._gather(probs)
            with torch.no_grad():
                routing_map = self._gather(routing_map.to(torch.int8)).bool()
        if self.ep_size == 1:
            out = self._route_and_compute(x, probs, routing_map)
        elif self.dispatcher == "alltoall":
            out = self._alltoall(x, probs, routing_map)
        else:
            out = self._allgather(x, probs, routing_map)
        if gather:
            out = tensor_parallel.reduce_scatter_to_sequence_parallel_region(out, self.etp_group)
        elif split_experts:
            out = tensor_parallel.reduce_from_tensor_model_parallel_region(out, self.etp_group)
        out = out.view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)[0]
        return out, None

    def _no_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Zero output when no row reaches this rank's experts (an expert-parallel rank that group-limited routing or
        the expert bias leaves idle): the expert weights still get (zero) grads, so every rank takes part in the
        same grad reductions and norm as when rows arrive."""
        return t * 0 + (self.experts.weight1.sum() + self.experts.weight2.sum()).to(t.dtype) * 0

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """The columns [T, E] -> [T, L] of this rank's experts."""
        n = self.experts.num_experts
        return t[:, self.ep_rank * n:(self.ep_rank + 1) * n]

    def _allgather(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """Tokens of the whole EP group through the local experts; partial outputs reduce-scattered back."""
        group = self.ep_group
        x = tensor_parallel.gather_from_sequence_parallel_region(x, group)
        probs = self._local(tensor_parallel.gather_from_sequence_parallel_region(probs, group))
        with torch.no_grad():
            routing_map = tensor_parallel.gather_from_sequence_parallel_region(routing_map.to(torch.int8), group)
        out = self._route_and_compute(x, probs, self._local(routing_map).bool())
        return tensor_parallel.reduce_scatter_to_sequence_parallel_region(out, group)

    def _alltoall(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """Rows permuted by global expert go to the expert's rank (all-to-all), through its local experts, back."""
        ep, n_local = self.ep_size, self.experts.num_experts
        mask = routing_map.t()  # [E, T]
        expert_of_row, token_of_row = mask.nonzero(as_tuple=True)
        counts = mask.sum(dim=1).view(ep, n_local)  # rows for rank r's local expert l
        row_probs = probs.t()[expert_of_row, token_of_row]
        with torch.no_grad():
            rows_of_token, uneven = moe_permute.inverse_table(token_of_row, x.shape[0])
        tokens = moe_permute.dispatch(x, token_of_row, rows_of_token, False, uneven)  # gathers both ways
        if self.config.moe_apply_probs_on_input:
            tokens = tokens * row_probs.unsqueeze(-1).to(tokens.dtype)
            row_probs = torch.ones_like(row_probs)
        recv_counts = expert_parallel.exchange_counts(counts, self.ep_group)  # [source rank, local expert]
        send_splits, recv_splits = counts.sum(dim=1).tolist(), recv_counts.sum(dim=1).tolist()
        tokens = expert_parallel.all_to_all(tokens, recv_splits, send_splits, self.ep_group)
        row_probs = expert_parallel.all_to_all(row_probs.unsqueeze(-1), recv_splits, send_splits,
                                               self.ep_group).squeeze(-1)
        # received rows: source-major, then local expert; a row's slot is its place among its expert's rows
        expert_of_recv = torch.repeat_interleave(torch.arange(n_local).repeat(ep), recv_counts.reshape(-1))
        per_expert = recv_counts.sum(dim=0)
        slots = int(per_expert.max()) if expert_of_recv.numel() else 0
        if slots == 0:  # the row probs too: their all-to-all's backward must run here as on the other ranks
            out = self._no_rows(tokens) + row_probs.sum().to(tokens.dtype) * 0
        else:
            order = torch.argsort(expert_of_recv, stable=True)
            starts = torch.cumsum(per_expert, 0) - per_expert
            slot_of_recv = torch.empty_like(expert_of_recv)
            slot_of_recv[order] = torch.arange(order.numel()) - starts[expert_of_recv[order]]
            out = self.experts(tokens, row_probs, expert_of_recv, slot_of_recv, slots)
        out = expert_parallel.all_to_all(out, send_splits, recv_splits, self.ep_group)
        return moe_permute.combine(out, rows_of_token, token_of_row, uneven, False).to(x.dtype)

    def _route_and_compute(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """Permute tokens by expert, run the batched experts, unpermute (weighted sum) to token order."""
        num_tokens = x.shape[0]
        mask = routing_map.t()  # [E, T]: tokens of each expert in token order (Megatron's permutation)
        expert_of_row, token_of_row = mask.nonzero(as_tuple=True)
        counts = mask.sum(dim=1)
        starts = torch.cumsum(counts, 0) - counts
        slot_of_row = torch.arange(token_of_row.numel()) - starts[expert_of_row]
        cfg = self.config
        if cfg.moe_pad_expert_input_to_capacity:
            slots = capacity_of(num_tokens // self.ep_size, cfg.num_moe_experts, cfg.moe_router_topk,
                                cfg.moe_expert_capacity_factor)
            slots = max(slots, int(counts.max()) if counts.numel() else 0)
        else:
            slots = int(counts.max()) if token_of_row.numel() else 0
        if slots == 0:  # the probs too: under EP their gather's backward must run here as on the other ranks
            return self._no_rows(x) + probs.sum().to(x.dtype) * 0
        row_probs = probs.t()[expert_of_row, token_of_row]
        out = self.experts.forward_tokens(x, row_probs, token_of_row, expert_of_row, slot_of_row, slots,
                                          cfg.moe_apply_probs_on_input)
        return out.to(x.dtype)
