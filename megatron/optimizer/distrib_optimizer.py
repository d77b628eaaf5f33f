"""The distributed optimizer (`--use-distributed-optimizer`, ZeRO-1 as in Megatron-LM).

The fp32 main params and the optimizer state (Adam exp_avg / exp_avg_sq, SGD momentum) are sharded over the
data-parallel ranks. The local DDP (`megatron.core.distributed.DistributedDataParallel`) lays every gradient buffer
out in buckets padded to a multiple of the data-parallel size; data-parallel rank r owns the r-th equal slice of each
bucket. Per step:

1. the DDP reduce-scatters each bucket (`finish_grad_sync`), so this rank holds the averaged grads of its shard;
2. the shard's main grads are views of that buffer (fp32) or fp32 copies of it (fp16/bf16 buffers); with fp16 the
   grads are unscaled and checked for inf/nan, the flag all-reduced over the data- and model-parallel groups;
3. the grad norm (clipping) and the zero count are computed over the shards: sums all-reduced over the
   data-parallel group, then the model-parallel group (TP-duplicated params counted on TP rank 0 only, the last
   stage's copy of the tied embedding not at all, as `clip_grads` does);
4. the inner torch optimizer steps the shard's main params: views into the model params for fp32 params, fp32
   copies for fp16/bf16 params (copied back into the model params' shard afterwards);
5. the DDP all-gathers the updated shards into the parameter buffer (`start_param_sync`; asynchronous with
   `--overlap-param-gather`, waited by the forward pre-hooks).

Checkpoints: `state_dict()` holds the non-sharded part (param-group hyperparameters, grad scaler);
`get_parameter_state()` (collective over the data-parallel group) returns, on data-parallel rank 0 (expert-data-parallel
rank 0 of each expert-parallel rank, under expert parallelism), the full fp32 params and optimizer state of every
parameter of this model-parallel rank, keyed by chunk and parameter name, which
`load_parameter_state()` slices on any data-parallel size (so a run can resume at another DP size).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.utils import unwrap_model as _unwrap
from megatron.optimizer.clip_grads import clip_grad_norm_fp32, count_zeros_fp32
from megatron.optimizer.grad_scaler import MegatronGradScaler
from megatron.optimizer.muon import muon_param_groups
from megatron.optimizer.optimizer import PARALLEL_ATTRS, MixedPrecisionOptimizer, StepResult, optimizer_timer
from megatron.optimizer.param_groups import get_param_groups

PARAM_STATE_FORMAT = "megatron-lite distributed optimizer, per-parameter fp32 state, v1"


def _active(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1




class _ShardEntry:
    """One model param's slice [lo, hi) (flat indices) owned by this data-parallel rank, and its main param."""

    __slots__ = ("chunk", "name", "model_param", "main_param", "lo", "hi")

    def __init__(self, chunk: int, name: str, model_param: torch.nn.Parameter, main_param: torch.Tensor,
                 lo: int, hi: int) -> None:
        self.chunk, self.name, self.model_param, self.main_param, self.lo, self.hi = (
            chunk, name, model_param, main_param, lo, hi)

    def model_grad_shard(self) -> torch.Tensor:
        return self.model_param.main_grad.view(-1)[self.lo:self.hi]

    def model_param_shard(self) -> torch.Tensor:
        return self.model_param.detach().view(-1)[self.lo:self.hi]


def shard_param_groups(model_chunks: Sequence[torch.nn.Module], param_groups: List[dict]
                       ) -> Tuple[List[dict], List[List[_ShardEntry]]]:
    """Replace each group's model params by this rank's main-param shards. Returns (groups for the inner torch
    optimizer, the shard entries of each group)."""
    index: Dict[torch.nn.Parameter, Tuple[int, str, Any, tuple]] = {}
    for c, chunk in enumerate(model_chunks):
        if not hasattr(chunk, "param_index_map") or not getattr(chunk, "use_distributed_optimizer", False):
            raise ValueError("--use-distributed-optimizer needs every model chunk wrapped in the local DDP built "
                             "with use_distributed_optimizer=True (use --DDP-impl local)")
        names = {p: n for n, p in _unwrap(chunk).named_parameters()}
        for param, entry in chunk.param_index_map.items():
            index[param] = (c, names[param], chunk, entry)
    shard_groups, entries = [], []
    for group in param_groups:
        group_entries = []
        for param in group["params"]:
            if param not in index:
                raise ValueError("a trainable parameter is not in any DDP gradient buffer")
            c, name, chunk, (_key, start, end, bucket) = index[param]
            shard_start, shard_end = bucket.shard_range()  # over the bucket's group (expert-DP for experts)
            lo, hi = max(start, shard_start) - start, min(end, shard_end) - start
            if hi <= lo:
                continue
            flat = param.detach().view(-1)[lo:hi]
            main = flat if param.dtype == torch.float32 else flat.clone().float()
            for attr in PARALLEL_ATTRS:
                if hasattr(param, attr):
                    setattr(main, attr, getattr(param, attr))
            group_entries.append(_ShardEntry(c, name, param, main, lo, hi))
        new_group = {k: v for k, v in group.items() if k != "params"}
        new_group["params"] = [e.main_param for e in group_entries]
        shard_groups.append(new_group)
        entries.append(group_entries)
    return shard_groups, entries


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Megatron's distributed optimizer over the local DDP chunks `model_chunks` (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, entries: List[List[_ShardEntry]],
                 model_chunks: Sequence[torch.nn.Module], clip_grad: float, log_num_zeros_in_grad: bool,
                 fp16: bool, bf16: bool, params_dtype: torch.dtype, grad_scaler: Optional[MegatronGradScaler],
                 model_parallel_group=None, tp_rank: int = 0, data_parallel_group=None) -> None:
        self.entries = entries
        self.model_chunks = list(model_chunks)
        self.data_parallel_group = data_parallel_group
        super().__init__(optimizer, clip_grad, log_num_zeros_in_grad, fp16, bf16, params_dtype, grad_scaler,
                         model_parallel_group, tp_rank)
        device = next((p.device for c in self.model_chunks for p in c.parameters()), torch.device("cpu"))
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._scale_one = torch.ones(1, dtype=torch.float32, device=device)
        self._device = device

    # ------------------------------------------------------------------ grads, norm, zeros
    def _all_entries(self) -> List[_ShardEntry]:
        return [e for group in self.entries for e in group]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for entry in self._all_entries():
            entry.main_param.grad = None
            entry.model_param.grad = None

    def _copy_model_grads_to_main_grads(self) -> None:
        for entry in self._all_entries():
            grad = entry.model_grad_shard()
            entry.main_param.grad = grad if grad.dtype == torch.float32 else grad.float()

    def _collect_main_grads(self) -> List[torch.Tensor]:
        return [e.main_param.grad for e in self._all_entries() if e.main_param.grad is not None]

    def _copy_main_params_to_model_params(self) -> None:
        for entry in self._all_entries():
            if entry.model_param.dtype != torch.float32:
                entry.model_param_shard().copy_(entry.main_param)

    def _copy_model_params_to_main_params(self) -> None:
        for entry in self._all_entries():
            if entry.model_param.dtype != torch.float32:
                entry.main_param.copy_(entry.model_param_shard())

    def reload_model_params(self) -> None:
        self._copy_model_params_to_main_params()

    def _inf_check_groups(self) -> tuple:
        # Each rank only sees its shard's grads: the flag must also travel over the data-parallel group.
        return (self.data_parallel_group, self.model_parallel_group, self.expert_parallel_group)

    def get_parameters(self) -> List[torch.Tensor]:
        return [e.main_param for e in self._all_entries()]

    def clip_grad_norm(self, clip_grad: float) -> float:
        params = self.get_parameters()
        return clip_grad_norm_fp32(params, max_norm=clip_grad, model_parallel_group=self.model_parallel_group,
                                   data_parallel_group=self.data_parallel_group, device=self._device,
                                   **self._expert_norm_kwargs(params, sharded=True))

    def count_zeros(self) -> int:
        return count_zeros_fp32(self.get_parameters(), self.model_parallel_group, self.tp_rank,
                                data_parallel_group=self.data_parallel_group, device=self._device,
                                expert_parallel_group=self.expert_parallel_group,
                                expert_data_parallel_group=self.expert_data_parallel_group,
                                expert_tensor_parallel_group=self.expert_tensor_parallel_group)

    # ------------------------------------------------------------------ step
    def finish_param_sync(self) -> None:
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    @torch.no_grad()
    def step(self, timers: Optional[Callable] = None) -> StepResult:
        """Shard grads → (unscale, inf check) → clip → inner step → copy to the model shard → all-gather params."""
        self.finish_param_sync()  # never update a shard an all-gather is still writing
        result = super().step(timers)
        if result[0]:
            optimizer_timer(timers, "params-all-gather").start()
            for chunk in self.model_chunks:
                chunk.start_param_sync()
            optimizer_timer(timers, "params-all-gather").stop()
        return result

    # ------------------------------------------------------------------ memory accounting
    def state_numel(self) -> Dict[str, int]:
        """Elements this rank actually holds: fp32 main params that are copies (not views of the model params),
        all fp32 main params, and the optimizer state tensors."""
        main = sum(e.main_param.numel() for e in self._all_entries())
        copies = sum(e.main_param.numel() for e in self._all_entries() if e.model_param.dtype != torch.float32)
        state = sum(v.numel() for s in self.optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        return {"main_params": main, "main_param_copies": copies, "optimizer_state": state}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The non-sharded part (saved in model_optim_rng.pt): hyperparameters and the grad scaler."""
        inner = self.optimizer.state_dict()
        state_dict: dict = {
            "distributed_optimizer": True,
            "optimizer": {"param_groups": inner["param_groups"], "state": {}},
        }
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        inner = state_dict["optimizer"] if "optimizer" in state_dict else state_dict  # regular fp32: torch layout
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if groups is not None:
            if len(groups) != len(self.optimizer.param_groups):
                raise ValueError(f"optimizer checkpoint has {len(groups)} param groups, this model has "
                                 f"{len(self.optimizer.param_groups)}; it is from a different model")
            for current, saved in zip(self.optimizer.param_groups, groups):
                current.update({k: v for k, v in saved.items() if k != "params"})
        if "grad_scaler" in state_dict and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _state_keys(self) -> List[str]:
        keys = set()
        for state in self.optimizer.state.values():
            keys.update(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
        return sorted(keys)

    def get_parameter_state(self) -> Optional[dict]:
        """Collective over the data-parallel group: the full per-parameter fp32 state on DP rank 0, None elsewhere.

        Each rank writes its shards into zero-filled full-size tensors, which are summed onto DP rank 0 (the shards
        are disjoint, so the sum is exact)."""
        self.finish_param_sync()
        keys = self._state_keys()
        key_list: list = [keys]
        if _active(self.data_parallel_group):  # ranks whose shards are all padding have no state yet
            gathered: list = [None] * dist.get_world_size(self.data_parallel_group)
            dist.all_gather_object(gathered, keys, group=self.data_parallel_group)
            key_list = gathered
        keys = sorted(set().union(*[set(k) for k in key_list]))
        step = 0.0
        for state in self.optimizer.state.values():
            if "step" in state:
                step = float(state["step"])
                break
        if _active(self.data_parallel_group):
            step_t = torch.tensor([step], dtype=torch.float64, device=self._device)
            dist.all_reduce(step_t, op=dist.ReduceOp.MAX, group=self.data_parallel_group)
            step = float(step_t.item())
        by_param = {e.model_param: e for e in self._all_entries()}
        chunks: List[Dict[str, Dict[str, torch.Tensor]]] = []
        for chunk in self.model_chunks:
            out: Dict[str, Dict[str, torch.Tensor]] = {}
            for name, param in _unwrap(chunk).named_parameters():
                if param not in chunk.param_index_map:
                    continue
                full = {k: torch.zeros(param.numel(), dtype=torch.float32, device=self._device)
                        for k in ["param", *keys]}
                entry = by_param.get(param)
                if entry is not None:
                    full["param"][entry.lo:entry.hi] = entry.main_param.detach().float()
                    state = self.optimizer.state.get(entry.main_param, {})
                    for k in keys:
                        if k in state:
                            full[k][entry.lo:entry.hi] = state[k].float()
                flat = torch.cat([full[k] for k in ["param", *keys]])
                group = chunk.param_index_map[param][3].group  # the data- or expert-data-parallel group
                if self.expert_parallel_group is not None:  # every expert-DP rank 0 writes: dense state everywhere
                    if _active(group):
                        dist.all_reduce(flat, group=group)
                elif _active(group):
                    dist.reduce(flat, dst=dist.get_global_rank(group, 0), group=group)
                pieces = flat.split(param.numel())
                out[name] = {k: piece.view(param.shape).clone() for k, piece in zip(["param", *keys], pieces)}
            chunks.append(out)
        writers = self.expert_data_parallel_group if self.expert_parallel_group is not None else \
            self.data_parallel_group
        if getattr(self, "expert_tensor_parallel_group", None) is None and \
                (dist.get_rank(writers) if _active(writers) else 0) != 0:  # (expert-TP != TP: every rank has it all;
            return None  # the checkpoint's writers are parallel_state.checkpoint_writer's)
        dp_size = dist.get_world_size(self.data_parallel_group) if _active(self.data_parallel_group) else 1
        return {"format": PARAM_STATE_FORMAT, "step": step, "state_keys": keys, "chunks": chunks,
                "saved_data_parallel_size": dp_size}

    def load_parameter_state(self, param_state: dict) -> None:
        """Slice the full per-parameter state (from `get_parameter_state`, any DP size) into this rank's shards,
        then all-gather the params so every data-parallel rank holds the loaded weights."""
        if param_state.get("format") != PARAM_STATE_FORMAT:
            raise ValueError("distrib_optim.pt is not in megatron-lite's per-parameter format; pass --no-load-optim")
        chunks = param_state["chunks"]
        if len(chunks) != len(self.model_chunks):
            raise ValueError(f"distrib_optim.pt holds {len(chunks)} model chunks, this run has "
                             f"{len(self.model_chunks)}; use the same --num-layers-per-virtual-pipeline-stage")
        keys = param_state["state_keys"]
        step = param_state["step"]
        for entry in self._all_entries():
            saved = chunks[entry.chunk].get(entry.name)
            if saved is None or saved["param"].numel() != entry.model_param.numel():
                raise ValueError(f"distrib_optim.pt has no state of the right size for {entry.name}; it is from a "
                                 "different model or tensor/pipeline layout")
            if any(k not in saved for k in keys):
                raise ValueError(f"distrib_optim.pt holds --optimizer muon state ({entry.name} has no "
                                 f"{'/'.join(k for k in keys if k not in saved)}), which the distributed optimizer "
                                 "does not take; resume with --optimizer muon or dist_muon, or pass --no-load-optim")
            with torch.no_grad():
                entry.main_param.copy_(saved["param"].view(-1)[entry.lo:entry.hi])
                if entry.model_param.dtype != torch.float32:
                    entry.model_param_shard().copy_(entry.main_param)
            if keys:
                state = {k: saved[k].view(-1)[entry.lo:entry.hi].to(self._device).clone() for k in keys}
                fused = bool(self.optimizer.defaults.get("fused"))
                state["step"] = torch.tensor(step, dtype=torch.float32,
                                             device=self._device if fused else torch.device("cpu"))
                self.optimizer.state[entry.main_param] = state
        for chunk in self.model_chunks:
            chunk.start_param_sync(async_op=False)


# ---------------------------------------------------------------------------------------------------- conversion
def model_param_order(model_chunks: Sequence[torch.nn.Module]) -> List[Tuple[int, str, torch.nn.Parameter]]:
    """(chunk, name, param) in the order of the regular optimizer's flat param indices (get_param_groups)."""
    names: Dict[torch.nn.Parameter, Tuple[int, str]] = {}
    for c, chunk in enumerate(model_chunks):
        for name, param in _unwrap(chunk).named_parameters():
            names.setdefault(param, (c, name))
    order = []
    for group in get_param_groups(list(model_chunks)):
        for param in group["params"]:
            c, name = names[param]
            order.append((c, name, param))
    return order


def regular_state_to_param_state(optim_sd: dict, model_chunks: Sequence[torch.nn.Module]) -> dict:
    """A regular (FP32Optimizer / Float16Optimizer) checkpoint's optimizer entry → the per-parameter state that
    `DistributedOptimizer.load_parameter_state` takes. The model weights must already be loaded."""
    inner = optim_sd["optimizer"] if "optimizer" in optim_sd and "param_groups" not in optim_sd else optim_sd
    if any(g.get("muon") for g in inner["param_groups"]):
        raise ValueError("the checkpoint holds --optimizer muon state, which the distributed optimizer does not take; "
                         "resume with --optimizer muon (without --use-distributed-optimizer) or --no-load-optim")
    order = model_param_order(model_chunks)
    flat_indices = [i for group in inner["param_groups"] for i in group["params"]]
    if len(flat_indices) != len(order):
        raise ValueError(f"the checkpoint's optimizer has {len(flat_indices)} params, the model {len(order)}")
    fp32_main = [t for group in optim_sd.get("fp32_from_fp16_params", []) for t in group]
    fp32_main_iter = iter(fp32_main)
    keys: set = set()
    step = 0.0
    chunks: List[Dict[str, Dict[str, torch.Tensor]]] = [{} for _ in model_chunks]
    for index, (c, name, param) in zip(flat_indices, order):
        value = next(fp32_main_iter) if fp32_main and param.dtype != torch.float32 else param.detach()
        entry = {"param": value.detach().float().clone()}
        state = inner["state"].get(index, {})
        for k, v in state.items():
            if k == "step":
                step = float(v)
            elif torch.is_tensor(v) and v.dim() > 0:
                entry[k] = v.float().clone()
                keys.add(k)
        chunks[c][name] = entry
    return {"format": PARAM_STATE_FORMAT, "step": step, "state_keys": sorted(keys), "chunks": chunks,
            "saved_data_parallel_size": None}


def param_state_to_regular_state(param_state: dict, common: dict, model_chunks: Sequence[torch.nn.Module],
                                 optimizer: Any) -> dict:
    """The distributed optimizer's checkpoint (per-parameter state + the common part) → a state dict that the
    regular optimizer `optimizer` (FP32Optimizer / Float16OptimizerWithFloat16Params) loads."""
    if param_state.get("format") != PARAM_STATE_FORMAT:
        raise ValueError("distrib_optim.pt is not in megatron-lite's per-parameter format; pass --no-load-optim")
    current = torch.optim.Optimizer.state_dict(optimizer.optimizer)["param_groups"]  # (dist_muon's own: collective)
    if any(g.get("muon") for g in current):
        return _muon_regular_state(param_state, common, model_chunks, optimizer, current)
    order = model_param_order(model_chunks)
    saved_groups = common.get("optimizer", {}).get("param_groups", [])
    groups = []
    for i, group in enumerate(current):
        merged = dict(saved_groups[i]) if i < len(saved_groups) else dict(group)
        merged["params"] = group["params"]
        groups.append(merged)
    state: Dict[int, dict] = {}
    fp32_from_fp16: List[List[torch.Tensor]] = [[] for _ in current]
    position = 0
    for g, group in enumerate(current):
        for index in group["params"]:
            c, name, param = order[position]
            position += 1
            saved = param_state["chunks"][c].get(name)
            if saved is None or saved["param"].numel() != param.numel():
                raise ValueError(f"distrib_optim.pt has no state of the right size for {name}")
            if param_state["state_keys"]:
                entry = {k: saved[k].view(param.shape).clone() for k in param_state["state_keys"]}
                entry["step"] = torch.tensor(float(param_state["step"]), dtype=torch.float32)
                state[index] = entry
            if param.dtype != torch.float32:
                fp32_from_fp16[g].append(saved["param"].view(param.shape).clone())
    return _regular_state_dict(optimizer, common, state, groups, fp32_from_fp16)


def _regular_state_dict(optimizer: Any, common: dict, state: Dict[int, dict], groups: List[dict],
                        fp32_from_fp16: List[List[torch.Tensor]]) -> dict:
    """The regular optimizer's state dict from its per-parameter state (wrapped with the fp32 copies and the grad
    scaler when the optimizer keeps fp32 main params)."""
    inner = {"state": state, "param_groups": groups}
    if not hasattr(optimizer, "fp32_from_float16_groups"):
        return inner
    out = {"optimizer": inner, "fp32_from_fp16_params": fp32_from_fp16}
    if "grad_scaler" in common:
        out["grad_scaler"] = common["grad_scaler"]
    return out


def _muon_regular_state(param_state: dict, common: dict, model_chunks: Sequence[torch.nn.Module], optimizer: Any,
                        current: List[dict]) -> dict:
    """`param_state_to_regular_state` for --optimizer muon / dist_muon: the per-parameter state (``momentum_buffer``
    of the Muon matrices, Adam's moments of the rest, as convert.py writes a Muon run's state) in the optimizer's
    own group order; this run's groups are kept (their hyperparameters are the scheduler's)."""
    chunks = [_unwrap(chunk) for chunk in model_chunks]
    split = any(g.get("qkv_split") for g in current)
    order = [p for group in muon_param_groups(chunks, get_param_groups(chunks), split) for p in group["params"]]
    names = {p: (c, n) for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}
    state: Dict[int, dict] = {}
    fp32_from_fp16: List[List[torch.Tensor]] = [[] for _ in current]
    position = 0
    for g, group in enumerate(current):
        for index in group["params"]:
            param = order[position]
            position += 1
            c, name = names[param]
            saved = param_state["chunks"][c].get(name)
            if saved is None or saved["param"].numel() != param.numel():
                raise ValueError(f"distrib_optim.pt has no state of the right size for {name}")
            if "momentum_buffer" in saved and not group.get("muon") or "exp_avg" in saved and group.get("muon"):
                raise ValueError(f"distrib_optim.pt holds another optimizer's state for {name} (Muon's for an Adam "
                                 "parameter or the reverse); resume with its optimizer flags, or pass --no-load-optim")
            entry = {k: v.view(param.shape).clone() for k, v in saved.items() if k != "param"}
            if entry and not group.get("muon"):
                entry["step"] = torch.tensor(float(param_state["step"]), dtype=torch.float32)
            if entry:
                state[index] = entry
            if param.dtype != torch.float32:
                fp32_from_fp16[g].append(saved["param"].view(param.shape).clone())
    return _regular_state_dict(optimizer, common, state, current, fp32_from_fp16)
