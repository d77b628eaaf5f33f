"""Training utilities: GPT masks/position ids, loss averaging, rank-aware printing, parameter norms, memory
reports, model unwrapping and the Megatron-DeepSpeed TFLOPs/throughput formula.
"""
from __future__ import annotations

import argparse
import resource
import sys
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from megatron import global_vars, logging_utils
from megatron.core.parallel_state import current_parallel_state
from megatron.core.rank_print import is_last_rank, print_rank_0, print_rank_last  # noqa: F401  (Megatron's path)
from megatron.core.utils import unwrap_model as _core_unwrap
from megatron.run_configs.throughput import ThroughputSettings

_CURRENT = object()  # sentinel: "use the current parallel state's group"


# --------------------------------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------------------------------










# --------------------------------------------------------------------------------------------------------------------
# Masks and position ids
# --------------------------------------------------------------------------------------------------------------------


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-to-right masks for GPT batches `data` [b, s].

    Returns (attention_mask bool [b or 1, 1, s, s] with True = masked out, loss_mask float [b, s],
    position_ids long [b, s]). With `reset_attention_mask` a token does not attend across an EOD token (the EOD
    belongs to the document it ends); with `reset_position_ids` positions restart after each EOD; with
    `eod_mask_loss` EOD tokens get no loss. Same results as Megatron's per-document loop, vectorised.
    """
    if data.dim() != 2:
        raise ValueError(
            f"get_ltor_masks_and_position_ids expects token ids [batch, seq], got shape {tuple(data.shape)}")
    micro_batch_size, seq_length = data.shape
    device = data.device
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).tril_()

    loss_mask = torch.ones(data.shape, dtype=torch.float, device=device)
    is_eod = data == eod_token
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    positions = torch.arange(seq_length, dtype=torch.long, device=device)
    if reset_position_ids or reset_attention_mask:
        # Document index of each token: number of EODs strictly before it.
        eod_long = is_eod.long()
        doc_id = torch.cumsum(eod_long, dim=1) - eod_long
    if reset_attention_mask:
        same_doc = doc_id.unsqueeze(2) == doc_id.unsqueeze(1)  # [b, s, s]
        allowed = same_doc & causal.unsqueeze(0)
        attention_mask = (~allowed).unsqueeze(1)
    else:
        attention_mask = (~causal).view(1, 1, seq_length, seq_length)

    if reset_position_ids:
        # Start of each token's document: one past the last EOD strictly before it (0 if none).
        after_eod = torch.zeros_like(data, dtype=torch.long)
        after_eod[:, 1:] = torch.where(is_eod[:, :-1], positions[1:].expand(micro_batch_size, -1),
                                       torch.zeros((), dtype=torch.long, device=device))
        doc_start = torch.cummax(after_eod, dim=1).values
        position_ids = positions.unsqueeze(0) - doc_start
    else:
        position_ids = positions.unsqueeze(0).expand(micro_batch_size, seq_length).clone()
    return attention_mask, loss_mask, position_ids


# --------------------------------------------------------------------------------------------------------------------
# Reductions
# --------------------------------------------------------------------------------------------------------------------


def _current_state():
    return current_parallel_state()


def _group_size(group: Any) -> int:
    if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size(group=group)


def average_losses_across_data_parallel_group(losses: Sequence[torch.Tensor], dp_group: Any = _CURRENT) -> torch.Tensor:
    """Mean of each (scalar) loss over the data-parallel group: returns a 1-D tensor, one entry per loss.

    `dp_group` defaults to the current parallel state's; None means no communication.
    """
    if dp_group is _CURRENT:
        dp_group = _current_state().dp_group
    averaged = torch.cat([loss.clone().detach().float().view(1) for loss in losses])
    size = _group_size(dp_group)
    if size > 1:
        torch.distributed.all_reduce(averaged, group=dp_group)
        averaged = averaged / size
    return averaged


def _model_chunks(model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> List[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def calc_params_l2_norm(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    mp_group: Any = _CURRENT,
    tp_rank: Optional[int] = None,
) -> float:
    """Global L2 norm of the model's parameters, counting tensor-parallel shards once and shared copies once.

    Parameters replicated across TP ranks (no `tensor_model_parallel` attribute) count only on tp_rank 0;
    parameters flagged `shared` (the last stage's copy of the tied embedding) are skipped. The squared norm is
    summed over `mp_group` (default: the current tensor x pipeline group; None = local only).
    """
    state = None
    if mp_group is _CURRENT or tp_rank is None:
        state = _current_state()
    if mp_group is _CURRENT:
        mp_group = state.mp_group
    if tp_rank is None:
        tp_rank = state.tp_rank
    total: Optional[torch.Tensor] = None
    for chunk in _model_chunks(model):
        for param in chunk.parameters():
            if getattr(param, "shared", False):
                continue
            if not getattr(param, "tensor_model_parallel", False) and tp_rank != 0:
                continue
            data = getattr(param, "main_param", None)
            data = param.detach() if data is None else data.detach()
            sq = torch.linalg.vector_norm(data.float()).double() ** 2
            total = sq if total is None else total + sq.to(total.device)
    if total is None:
        total = torch.zeros((), dtype=torch.float64)
    if _group_size(mp_group) > 1:
        if torch.distributed.get_backend(mp_group) == "nccl":
            total = total.cuda()
        total = total.reshape(1)
        torch.distributed.all_reduce(total, group=mp_group)
    return float(total.sum().item()) ** 0.5


# --------------------------------------------------------------------------------------------------------------------
# Memory, unwrapping, throughput
# --------------------------------------------------------------------------------------------------------------------


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


def report_memory(name: str) -> str:
    """Print (from data-parallel rank 0) and return Megatron's memory line; see megatron.logging_utils.report_memory."""
    line = logging_utils.report_memory(name)
    if line is not None:
        return line
    return f"{name} memory (MB)" + "".join(f" | {k}: {v}" for k, v in logging_utils.memory_stats_mb().items())


def _default_wrapper_classes() -> Tuple[type, ...]:
    classes: List[type] = [torch.nn.parallel.DistributedDataParallel]
    for module_name, class_names in (
        ("megatron.core.distributed", ("DistributedDataParallel", "TorchDistributedDataParallel", "TorchDDP")),
        ("megatron.layers.module", ("Float16Module",)),
    ):
        try:
            module = __import__(module_name, fromlist=list(class_names))
        except Exception:  # noqa: BLE001 - optional wrappers
            continue
        for class_name in class_names:
            cls = getattr(module, class_name, None)
            if isinstance(cls, type) and cls not in classes:
                classes.append(cls)
    return tuple(classes)


def unwrap_model(model: Any, module_instances: Optional[Iterable[type]] = None) -> Any:
    """Megatron's `megatron.utils.unwrap_model`: megatron.core.utils.unwrap_model with Megatron's default wrapper
    classes (DDP, Float16Module, ...) when `module_instances` is not given; keeps list-ness."""
    instances = tuple(module_instances) if module_instances is not None else _default_wrapper_classes()
    return _core_unwrap(model, instances) if instances else model


def get_parameters_in_billions(model: Any, mp_group: Any = _CURRENT) -> float:
    """Approximate model size: local parameter count x model-parallel world size, in billions."""
    if mp_group is _CURRENT:
        mp_group = _current_state().mp_group
    local = sum(p.ds_numel if hasattr(p, "ds_id") else p.nelement()
                for chunk in _model_chunks(model) for p in chunk.parameters())
    return local * _group_size(mp_group) / 1e9


def get_model_flops_per_iteration(args: argparse.Namespace, batch_size: Optional[int] = None) -> float:
    """Megatron-DeepSpeed's estimate of model FLOPs per iteration.

    F = 24·k·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), k = 4 with full activation recomputation (96·…), else 3 (72·…).
    B defaults to the global batch size (micro x num micro-batches x DP).
    """
    return model_flops_per_iteration(ThroughputSettings.from_args(args), batch_size)


def model_flops_per_iteration(run: ThroughputSettings, batch_size: Optional[int] = None) -> float:
    """get_model_flops_per_iteration on typed settings."""
    if batch_size is None:
        batch_size = run.global_batch_size
        if batch_size is None:
            batch_size = run.micro_batch_size * run.data_parallel_size
    seq = run.seq_length
    h, layers, vocab = run.hidden_size, run.num_layers, run.padded_vocab_size
    factor = 4 if run.recompute_full else 3
    return (24.0 * factor * batch_size * seq * layers * h * h) * (
        1.0 + seq / (6.0 * h) + vocab / (16.0 * layers * h)
    )


def throughput_calculator(
    model: Any, args: argparse.Namespace, iteration_time: float, total_iterations: int,
    batch_size: Optional[int] = None,
) -> Tuple[float, float, Optional[float]]:
    """(samples/s, TFLOPs per GPU, parameters in billions) for `total_iterations` taking `iteration_time` seconds.

    `batch_size` defaults to the current global batch size (micro x num micro-batches x DP).
    """
    return throughput(model, ThroughputSettings.from_args(args), iteration_time, total_iterations, batch_size)


def throughput(
    model: Any, run: ThroughputSettings, iteration_time: float, total_iterations: int,
    batch_size: Optional[int] = None,
) -> Tuple[float, float, Optional[float]]:
    """throughput_calculator on typed settings."""
    if total_iterations <= 0 or iteration_time <= 0:
        raise ValueError("throughput_calculator needs positive iteration_time and total_iterations")
    if batch_size is None:
        try:
            batch_size = run.micro_batch_size * global_vars.get_num_microbatches() * run.data_parallel_size
        except RuntimeError:
            batch_size = run.global_batch_size or run.micro_batch_size * run.data_parallel_size
    params_b = None if model is None else get_parameters_in_billions(model)
    per_iter = iteration_time / total_iterations
    samples_per_second = batch_size / per_iter
    flops = model_flops_per_iteration(run, batch_size)
    tflops = flops / (per_iter * run.world_size * 1e12)
    return samples_per_second, tflops, params_b
