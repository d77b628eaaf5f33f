"""Non-finite loss / gradient detection for the training loop (--check-for-nan-in-loss-and-grad, on by default).

Before the optimizer step, `loss_and_grads_finite` checks this iteration's loss (last pipeline stage) and gradient
norm on every rank and agrees on the answer over the whole job (one all-reduce of one number); a non-finite one skips
the step (weights, optimizer state and LR schedule untouched) and the iteration is counted as skipped and as a nan
iteration. `SkipCounter` stops the run with one line after --max-skipped-iterations consecutive skipped iterations
(fp16 overflow skips count only once the loss scale is at --min-loss-scale, since the dynamic scaler normally skips a
few dozen steps while it backs off from 2^32). `params_finite` guards checkpoint saves: no non-finite weights are ever
written.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch

from megatron.errors import MegatronUserError


class NonFiniteTrainingError(MegatronUserError, RuntimeError):
    """Training stopped: too many consecutive iterations with a non-finite loss or gradient norm."""


def _grads(model: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    out = []
    for chunk in model:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None and grad.numel() > 0:
                out.append(grad)
    return out


def _norm_sq(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared L2 norms in fp32 (inf/nan when any element is, or when it overflows)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.stack(list(norms)).pow(2).sum()


def _any_rank(bad: bool) -> bool:
    """True when `bad` on any rank of the job (one all-reduce; on the GPU with NCCL)."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return bad
    device = torch.device("cpu")
    if torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1.0 if bad else 0.0], dtype=torch.float32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0)


def loss_and_grads_finite(losses_reduced: Optional[list], model: Iterable[torch.nn.Module], check_grads: bool = True
                          ) -> tuple[bool, float]:
    """(every rank's loss and gradient norm finite, this rank's gradient norm) — collective over the whole job.
    With fp16 (check_grads=False) only the loss is checked: scaled-gradient overflows are the loss scaler's job."""
    bad = 0.0
    for entry in losses_reduced or []:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            value = value.detach().float() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            if not bool(torch.isfinite(value).all()):
                bad = 1.0
    grad_norm_sq = _norm_sq(_grads(model)) if check_grads else torch.zeros((), dtype=torch.float32)
    if not bool(torch.isfinite(grad_norm_sq)):
        bad = 1.0
    norm_sq = float(grad_norm_sq)
    return not _any_rank(bad > 0), math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("nan")


def params_finite(model: Iterable[torch.nn.Module]) -> bool:
    """Every parameter of every chunk finite on every rank (collective)."""
    params = [p.detach() for chunk in model for p in chunk.parameters() if p.numel() > 0]
    total = _norm_sq(params)
    bad = not (bool(torch.isfinite(total)) or _each_finite(params))
    return not _any_rank(bad)


def _each_finite(tensors: list[torch.Tensor]) -> bool:
    """Slow path when the squared norm overflowed: are the elements themselves finite (just large)?"""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class SkipCounter:
    """Consecutive skipped iterations; raises NonFiniteTrainingError at the limit (0 disables the limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.consecutive = 0

    def update(self, iteration: int, skipped: bool, nonfinite: bool, loss_scale: Optional[float],
               min_loss_scale: Optional[float]) -> None:
        """`nonfinite`: the loss or grad norm was non-finite; other skips (fp16 overflow) count only at the minimum
        loss scale."""
        at_floor = loss_scale is not None and min_loss_scale is not None and loss_scale <= min_loss_scale
        if nonfinite or (skipped and at_floor):  # (DeepSpeed applies some non-finite steps itself: they count too)
            self.consecutive += 1
        elif not skipped:
            self.consecutive = 0
        if self.limit > 0 and self.consecutive >= self.limit:
            raise NonFiniteTrainingError(
                f"stopped at iteration {iteration}: {self.consecutive} consecutive iterations skipped with a "
                f"non-finite loss or gradient norm (--max-skipped-iterations {self.limit}); nothing non-finite was "
                "saved: lower --lr, check the data, or resume from the last checkpoint")


def is_finite_number(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
