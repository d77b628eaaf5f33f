"""Muon (momentum orthogonalized by Newton-Schulz) as Megatron-LM core 0.16.1 defines it, with AdamW for the rest.

`--optimizer muon`: 2-D weights other than the word embeddings and the output layer get Muon (Megatron's rule:
``not is_embedding_or_output_parameter and param.dim() == 2``; our stacked MoE expert weights [E, in, out] get it per
expert, as Megatron's per-expert expert linears do); embeddings, output layer, norms and biases get Adam (decoupled
weight decay, i.e. AdamW). One step of a Muon parameter (megatron-core's TensorParallelMuon over emerging-optimizers'
OrthogonalizedOptimizer):

    p -= lr * wd * p                                   (decoupled weight decay)
    m = lerp(m, g, 1 - momentum)                       (--muon-momentum)
    u = lerp(g, m, momentum) if --muon-use-nesterov else m
    p -= lr * NS(u) * scale(rows, cols) * --muon-extra-scale-factor

NS is --muon-num-ns-steps Newton-Schulz iterations with the "quintic" coefficient schedule on the Frobenius-normalised
matrix (transposed so rows <= cols), in bf16 when --muon-fp32-matmul-prec is medium (Megatron's default); scale is
--muon-scale-mode's. The fused QKV weight is orthogonalised per Q, K, V part (over all query groups) unless
--muon-no-split-qkv. With tensor parallelism (--muon-tp-mode) each rank orthogonalises its own shard (`blockwise`),
the gathered full matrix (`duplicated`), or the full matrix with distributed matmuls (`distributed`); the last two
equal the serial run.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.optimizer.layer_wise import LayerWiseShards

NS_COEFFICIENTS: Dict[str, List[Tuple[float, float, float]]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],  # torch.optim.Muon's (constant) coefficients
    "quintic": [  # Megatron-LM core's (emerging-optimizers' default) 5-step schedule
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
}
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
NS_EPS = 1e-7


def muon_scale_factor(size_out: int, size_in: int, mode: str = "spectral") -> float:
    """The update's scale for an [out, in] matrix: spectral sqrt(max), unit_rms_norm sqrt(out/in), shape_scaling
    sqrt(max(1, out/in))."""
    if mode == "shape_scaling":
        return max(1, size_out / size_in) ** 0.5
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    raise ValueError(f"--muon-scale-mode {mode!r} is not one of {', '.join(MUON_SCALE_MODES)}")


@contextlib.contextmanager
def fp32_matmul_precision(precision: str) -> Iterator[None]:
    """torch's float32 matmul precision set to `precision` for the block."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _ns_step(x: torch.Tensor, a: float, b: float, c: float, tp_group: Any) -> torch.Tensor:
    gram = x @ x.mT
    if tp_group is not None:
        torch.distributed.all_reduce(gram, group=tp_group)
    poly = torch.addmm(gram, gram, gram, alpha=c, beta=b)
    return torch.addmm(x, poly, x, alpha=1.0, beta=a)


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str = "quintic", transpose: Optional[bool] = None,
                  tp_group: Any = None) -> torch.Tensor:
    """Orthogonalise the fp32 matrix `x` (≈ U Vᵀ of its SVD) with `steps` Newton-Schulz iterations. With `tp_group`
    `x` is a shard along the dimension that `transpose` makes the columns, and the Gram matrices are all-reduced."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"Newton-Schulz needs a 2-D float32 matrix, got {tuple(x.shape)} {x.dtype}")
    coefficients = NS_COEFFICIENTS[coefficient_type]
    if steps % len(coefficients):
        raise ValueError(f"--muon-num-ns-steps ({steps}) must be a multiple of {len(coefficients)} (the length of "
                         f"the {coefficient_type} coefficient schedule)")
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    if tp_group is None:
        x = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=NS_EPS)
    else:
        sq = (x * x).sum()
        torch.distributed.all_reduce(sq, group=tp_group)
        x = x / torch.sqrt(sq).clamp_min(NS_EPS)
    if torch.get_float32_matmul_precision() == "medium":  # fp32 in and out, bf16 compute (as Megatron)
        x = x.to(torch.bfloat16)
    for i in range(steps):
        a, b, c = coefficients[i % len(coefficients)]
        x = _ns_step(x, a, b, c, tp_group)
    x = x.to(torch.float32)
    return x.mT if transpose else x


def orthogonalize_tp(x: torch.Tensor, steps: int, coefficient_type: str, tp_group: Any,
                     partition_dim: Optional[int], mode: str) -> torch.Tensor:
    """Newton-Schulz of a tensor-parallel shard: `partition_dim` None (not split, or `blockwise`) orthogonalises the
    shard alone; `duplicated` gathers the full matrix and keeps this rank's piece; `distributed` runs the iteration on
    the shards with all-reduced Gram matrices."""
    if partition_dim is None or tp_group is None:
        return newton_schulz(x, steps, coefficient_type)
    world, rank = torch.distributed.get_world_size(tp_group), torch.distributed.get_rank(tp_group)
    if mode == "duplicated":
        shards = [torch.empty_like(x) for _ in range(world)]
        torch.distributed.all_gather(shards, x.contiguous(), group=tp_group)
        full = newton_schulz(torch.cat(shards, dim=partition_dim), steps, coefficient_type)
        return full.chunk(world, dim=partition_dim)[rank]
    return newton_schulz(x, steps, coefficient_type, transpose=partition_dim == 0, tp_group=tp_group)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the param groups marked ``muon=True``, AdamW (torch's, sharing this optimizer's state) for the
    others. A Muon group may carry ``qkv_split`` (Q, K, V rows per query group), ``expert`` (stacked [E, in, out]
    weights, orthogonalised per expert over `expert_tp_group`); each parameter's ``partition_dim`` attribute says how
    tensor parallelism splits it. State: ``momentum_buffer`` (Muon), ``exp_avg``/``exp_avg_sq``/``step`` (Adam).
    With `dp_group` (`--optimizer dist_muon`) the parameters are distributed layer-wise over the data-parallel ranks
    (megatron/optimizer/layer_wise.py): each rank steps its own, then all are all-gathered; `state_dict` is then a
    collective that returns every parameter's state."""

    def __init__(self, param_groups: List[dict], *, lr: float, weight_decay: float, momentum: float = 0.9,
                 nesterov: bool = False, scale_mode: str = "spectral", extra_scale_factor: float = 1.0,
                 num_ns_steps: int = 5, fp32_matmul_prec: str = "medium", tp_mode: str = "blockwise",
                 coefficient_type: str = "quintic", betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 tp_group: Any = None, expert_tp_group: Any = None, adam_fused: Optional[bool] = None,
                 dp_group: Any = None, expert_dp_group: Any = None) -> None:
        muon_scale_factor(1, 1, scale_mode)  # validates the mode
        if tp_mode not in MUON_TP_MODES:
            raise ValueError(f"--muon-tp-mode {tp_mode!r} is not one of {', '.join(MUON_TP_MODES)}")
        if num_ns_steps < 1:
            raise ValueError(f"--muon-num-ns-steps must be at least 1, got {num_ns_steps}")
        self.momentum, self.nesterov, self.scale_mode = momentum, nesterov, scale_mode
        if fp32_matmul_prec not in ("medium", "high", "highest"):
            raise ValueError(f"--muon-fp32-matmul-prec {fp32_matmul_prec!r}: torch has no such float32 matmul "
                             "precision; use medium (bf16 Newton-Schulz, the default) or high (fp32)")
        self.extra_scale_factor, self.num_ns_steps = extra_scale_factor, num_ns_steps
        self.fp32_matmul_prec = fp32_matmul_prec
        self.tp_mode, self.coefficient_type = tp_mode, coefficient_type
        self.tp_group, self.expert_tp_group = tp_group, expert_tp_group
        super().__init__(param_groups, dict(lr=lr, weight_decay=weight_decay, muon=False))
        adam_groups = [g for g in self.param_groups if not g["muon"]]
        self._adam = torch.optim.AdamW(adam_groups or [{"params": []}], lr=lr, weight_decay=weight_decay,
                                       betas=betas, eps=eps, fused=adam_fused if adam_groups else None)
        self._link_adam()
        self.layer_wise = LayerWiseShards(self.param_groups, dp_group, expert_dp_group) if dp_group is not None \
            else None

    def _link_adam(self) -> None:
        """The AdamW instance steps this optimizer's own non-Muon group dicts and state (also after a load)."""
        adam_groups = [g for g in self.param_groups if not g["muon"]]
        if adam_groups:
            for group in adam_groups:
                for key, value in self._adam.defaults.items():
                    group.setdefault(key, value)
            self._adam.param_groups = adam_groups
        self._adam.state = self.state

    @property
    def state_dict_is_collective(self) -> bool:
        """True when `state_dict` gathers the layer-wise distributed state (every data-parallel rank must call it)."""
        return self.layer_wise is not None and bool(self.layer_wise.domains)

    def state_dict(self) -> dict:
        """torch's state dict; layer-wise distributed: with every rank's state (collective)."""
        state_dict = super().state_dict()
        if self.state_dict_is_collective:
            state_dict["state"] = self.layer_wise.gather_state(state_dict["state"], self.param_groups)
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the AdamW part pointed at the loaded groups and state again (and, layer-wise
        distributed, the state of the parameters other ranks own dropped)."""
        super().load_state_dict(state_dict)
        self._link_adam()
        if self.layer_wise is not None:
            self.layer_wise.prune_state(self)

    def _owns(self, group_index: int, param_index: int) -> bool:
        return self.layer_wise is None or (group_index, param_index) in self.layer_wise.owned

    def _orthogonalize(self, param: torch.Tensor, update: torch.Tensor, group: dict) -> torch.Tensor:
        """The scaled orthogonalised update of one [out, in] matrix (its Q/K/V parts separately when split)."""
        tp_group = self.expert_tp_group if group.get("expert") else self.tp_group
        pdim = getattr(param, "partition_dim", -1) if self.tp_mode != "blockwise" else -1
        pdim = None if pdim in (-1, None) or tp_group is None or torch.distributed.get_world_size(tp_group) == 1 \
            else pdim
        if group.get("expert"):  # stacked [E, in, out]: per expert, as its [out, in] matrix
            pdim = None if pdim is None else 2 - pdim  # dim 2 (out) -> 0, dim 1 (in) -> 1
            return torch.stack([self._scaled(u.t(), tp_group, pdim).t() for u in update])
        split = group.get("qkv_split")
        if not split:
            return self._scaled(update, tp_group, pdim)
        rows = sum(split)
        parts = torch.split(update.view(update.shape[0] // rows, rows, -1), list(split), dim=1)
        groups_here = update.shape[0] // rows
        done = [self._scaled(p.reshape(-1, update.shape[-1]), tp_group, pdim).view(groups_here, -1, update.shape[-1])
                for p in parts]
        return torch.cat(done, dim=1).view(update.shape)

    def _scaled(self, update: torch.Tensor, tp_group: Any, pdim: Optional[int]) -> torch.Tensor:
        size = [update.size(0), update.size(1)]
        if pdim is not None:
            size[pdim] *= torch.distributed.get_world_size(tp_group)
        out = orthogonalize_tp(update, self.num_ns_steps, self.coefficient_type, tp_group, pdim, self.tp_mode)
        return out * muon_scale_factor(size[0], size[1], self.scale_mode) * self.extra_scale_factor

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Muon step of the Muon groups, one AdamW step of the others."""
        loss = closure() if closure is not None else None
        for g, group in enumerate(self.param_groups):
            if not group["muon"]:
                continue
            lr, wd = group["lr"], group["weight_decay"]
            for i, p in enumerate(group["params"]):
                if p.grad is None or not self._owns(g, i):
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                if wd != 0.0:
                    p.add_(p, alpha=-wd * lr)
                buf.lerp_(p.grad, 1 - self.momentum)
                update = p.grad.lerp(buf, self.momentum) if self.nesterov else buf
                with fp32_matmul_precision(self.fp32_matmul_prec):
                    update = self._orthogonalize(p, update, group)
                p.add_(update, alpha=-lr)
        self._adam_step()
        if self.layer_wise is not None:
            self.layer_wise.all_gather_params(self.param_groups)
        return loss

    def _adam_step(self) -> None:
        """AdamW over the non-Muon groups (layer-wise distributed: over this rank's parameters of them)."""
        groups = [(g, group) for g, group in enumerate(self.param_groups) if not group["muon"]]
        if self.layer_wise is None:
            if groups:
                self._adam.step()
            return
        linked = self._adam.param_groups
        mine = [{**group, "params": [p for i, p in enumerate(group["params"]) if self._owns(g, i)]}
                for g, group in groups]
        self._adam.param_groups = [group for group in mine if group["params"]]
        try:
            if self._adam.param_groups:
                self._adam.step()
        finally:
            self._adam.param_groups = linked


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """Megatron's split: 2-D weights (and our stacked 3-D expert weights) except the word embeddings and the output
    layer get Muon."""
    if name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight"):
        return False
    return param.dim() == 2 or (param.dim() == 3 and is_expert_param(name))


def is_expert_param(name: str) -> bool:
    """A routed expert's weight (Megatron's test: 'experts' in the name, 'shared' not)."""
    return "experts" in name and "shared" not in name


def qkv_split_shapes(model_chunks: Sequence[torch.nn.Module]) -> Optional[Tuple[int, int, int]]:
    """Rows of Q, K and V per query group of the fused QKV weight, from the model's config (None without one)."""
    for chunk in model_chunks:
        for module in chunk.modules():
            cfg = getattr(module, "config", None)
            if cfg is not None and getattr(cfg, "num_query_groups", None) and getattr(cfg, "kv_channels", None):
                heads, groups, kv = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
                return heads // groups * kv, kv, kv
    return None


def muon_param_groups(model_chunks: Sequence[torch.nn.Module], groups: List[dict], split_qkv: bool) -> List[dict]:
    """Megatron's groups split into Muon groups (first; QKV weights and expert weights in their own) and Adam groups,
    each keeping its wd_mult / lr_mult."""
    names = {id(p): n for chunk in model_chunks for n, p in chunk.named_parameters()}
    return split_muon_groups(groups, names, qkv_split_shapes(model_chunks) if split_qkv else None)


def split_muon_groups(groups: List[dict], names: Dict[int, str], qkv_shapes: Optional[Tuple[int, int, int]]
                      ) -> List[dict]:
    """`muon_param_groups` on groups of any tensors (`names`: their names by id; `qkv_shapes`: the QKV split or None),
    so checkpoint conversion orders a saved Muon state's parameters as the optimizer did."""
    shapes = qkv_shapes
    muon: Dict[Tuple, dict] = {}
    adam: List[dict] = []
    for group in groups:
        rest = []
        for p in group["params"]:
            name = names.get(id(p), "")
            if not is_muon_param(name, p):
                rest.append(p)
                continue
            qkv = shapes if shapes and name.endswith("query_key_value.weight") and p.dim() == 2 else None
            kind = (group["wd_mult"], group["lr_mult"], qkv, is_expert_param(name))
            muon.setdefault(kind, {**{k: v for k, v in group.items() if k != "params"}, "params": [], "muon": True,
                                   "qkv_split": qkv, "expert": kind[3]})["params"].append(p)
        if rest:
            adam.append({**group, "params": rest, "muon": False})
    return list(muon.values()) + adam

