"""Non-finite loss / gradient detection for the training loop (--check-for-nan-in-loss-and-grad, on by default).

Before the optimizer step, `loss_and_grads_finite` checks this iteration's loss (last pipeline stage) and gradient
norm on every rank and agrees on the answer over the whole job (one all-reduce of one number); a non-finite one skips
the step (weights, optimizer state and LR schedule untouched) and the iteration is counted as skipped and as a nan
iteration. `SkipCounter` stops the run with one line after --max-skipped-iterations consecutive skipped iterations
(fp16 overflow skips count only once the loss scale is at --min-loss-scale, since the dynamic scaler normally skips a
few dozen steps while it backs off from 2^32). `params_finite` guards checkpoint saves: no non-finite weights are ever
written, and no checkpoint is written during a non-finite streak (the weights it would hold are the ones that diverged);
the stop line names the newest checkpoint written before the streak. `loaded_state_problem` refuses a loaded
checkpoint that holds non-finite values, and `FirstLossWatch` stops a run whose first losses after loading an
unverified checkpoint (no manifest) are non-finite or many times the loss the checkpoint recorded; until it has
passed, saves are not signed (`SkipCounter.may_sign`: no manifest vouches for bytes that were never verified).
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


def local_grad_norm(model: Iterable[torch.nn.Module]) -> torch.Tensor:
    """This rank's L2 norm of its gradients (main_grad where the DDP buffers hold them), fp32; not collective."""
    return _norm_sq(_grads(model)).sqrt()


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
    """Consecutive skipped iterations; raises NonFiniteTrainingError at the limit (0 disables the limit).

    Also remembers the checkpoints of the run (`checkpoint`: the loaded one and every save) and where the current
    non-finite streak began, so that saves can be withheld during a streak (`in_streak`) and the stop line can name
    the newest checkpoint written before it."""

    def __init__(self, limit: int, loaded: Optional[tuple[int, str]] = None) -> None:
        self.limit = int(limit)
        self.consecutive = 0
        self.streak_start: Optional[int] = None
        self.loaded = loaded  # (the run's first iteration, "iteration N in DIR") of the checkpoint it started from
        self.checkpoints: list[tuple[int, str]] = [loaded] if loaded else []  # (iteration of the run, description)
        self.last_loss: Optional[float] = None  # the last finite training loss (the training loop sets it)
        self.watch: Optional[FirstLossWatch] = None  # set after loading an unverified checkpoint

    def may_sign(self, iteration: int) -> bool:
        """Whether the checkpoint of `iteration` may get a manifest: not while the first losses after loading an
        unverified checkpoint are still being checked (its bytes were never verified)."""
        return self.watch is None or self.watch.passed(iteration)

    def checkpoint(self, iteration: int, save_dir: str) -> None:
        self.checkpoints.append((iteration, f"iteration {iteration} in {save_dir}"))

    @property
    def in_streak(self) -> bool:
        return self.consecutive > 0

    def update(self, iteration: int, skipped: bool, nonfinite: bool, loss_scale: Optional[float],
               min_loss_scale: Optional[float]) -> None:
        """`nonfinite`: the loss or grad norm was non-finite; other skips (fp16 overflow) count only at the minimum
        loss scale."""
        at_floor = loss_scale is not None and min_loss_scale is not None and loss_scale <= min_loss_scale
        if nonfinite or (skipped and at_floor):  # (DeepSpeed applies some non-finite steps itself: they count too)
            if self.consecutive == 0:
                self.streak_start = iteration
            self.consecutive += 1
        elif not skipped:
            self.consecutive = 0
            self.streak_start = None
        if self.limit > 0 and self.consecutive >= self.limit:
            raise NonFiniteTrainingError(
                f"stopped at iteration {iteration}: {self.consecutive} consecutive iterations skipped with a "
                f"non-finite loss or gradient norm since iteration {self.streak_start} (--max-skipped-iterations "
                f"{self.limit}); nothing was saved during them; {self.advice()}")

    def advice(self) -> str:
        """Where to resume from: the newest checkpoint written before the streak began."""
        start = self.streak_start if self.streak_start is not None else 0
        if self.loaded is not None and start == self.loaded[0] + 1:
            return (f"the checkpoint it started from ({self.loaded[1]}) gives a "
                    "non-finite loss or gradient at once, so it is damaged, not the learning rate: resume from an "
                    "earlier checkpoint (edit latest_checkpointed_iteration.txt) or start without --load")
        before = [c for c in self.checkpoints if c[0] < start]
        if not before:
            return "no checkpoint was written before it: lower --lr or check the data, and start again"
        newest = before[-1]
        where = newest[1]
        if newest[0] == start - 1:  # it holds the weights whose forward pass was the first non-finite one
            older = [c for c in before if c[0] < newest[0]]
            earlier = (f"resume from {older[-1][1]} (edit latest_checkpointed_iteration.txt)" if older
                       else "start again")
            return (f"the newest checkpoint before it, {where}, holds the weights that gave the first non-finite "
                    f"loss (resuming it repeats the failure): {earlier} with a lower --lr, or check the data")
        return f"the newest checkpoint before it is {where}: resume from it with a lower --lr, or check the data"


def loaded_state_problem(model: Iterable[torch.nn.Module], optimizer: Any) -> Optional[str]:
    """'weights' or 'optimizer state' when the loaded model / optimizer holds non-finite values on any rank (collective),
    else None."""
    if not params_finite(model):
        return "weights"
    bad = False
    if optimizer is not None:
        tensors = [t for t in _optimizer_tensors(optimizer) if t.is_floating_point() and t.numel() > 0]
        bad = bool(tensors) and not (bool(torch.isfinite(_norm_sq(tensors))) or _each_finite(tensors))
    return "optimizer state" if _any_rank(bad) else None


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    out = [p.detach() for p in getattr(optimizer, "get_parameters", lambda: [])()]
    state = getattr(optimizer, "state", None)
    if isinstance(state, dict):
        for entry in state.values():
            if isinstance(entry, dict):
                out.extend(v.detach() for v in entry.values() if isinstance(v, torch.Tensor))
    return out


class FirstLossWatch:
    """After loading an unverified checkpoint (no manifest): the first `iterations` losses must be finite and below
    `factor` x the loss the checkpoint recorded (or 2 ln(vocabulary) when it recorded none); otherwise one line naming
    the checkpoint. Collective (call on every rank with this rank's losses; only the last stage has them)."""

    def __init__(self, checkpoint: str, first_iteration: int, recorded_loss: Optional[float],
                 vocab_size: Optional[int], iterations: int = 3, factor: float = 5.0) -> None:
        self.checkpoint, self.recorded = checkpoint, recorded_loss
        self.last = first_iteration + iterations - 1
        floor = 2.0 * math.log(vocab_size) if vocab_size and vocab_size > 1 else 0.0
        self.limit = max(factor * recorded_loss if recorded_loss else 0.0, floor) or math.inf

    def passed(self, iteration: int) -> bool:
        """Whether every watched iteration up to `iteration` has been checked (`iteration` is the last one done)."""
        return iteration >= self.last

    def check(self, iteration: int, losses: dict) -> None:
        if iteration > self.last:
            return
        total = sum(float(v) for v in losses.values()) if losses else 0.0
        bad = bool(losses) and not (math.isfinite(total) and total <= self.limit)
        if not _any_rank(bad):
            return
        recorded = f"{self.recorded:.4g}" if self.recorded else "none"
        shown = f"{total:.4g}" if losses else "non-finite or exploding"
        raise NonFiniteTrainingError(
            f"stopped at iteration {iteration}: the loss ({shown}; the checkpoint recorded {recorded}) exploded "
            f"right after loading {self.checkpoint}, which has no manifest.json and was loaded unverified: its bytes "
            "are likely damaged; resume from a checkpoint that verifies, or start without --load")


def is_finite_number(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
