"""Megatron's own training backend: our DDP / distributed optimizer, Megatron's pipeline schedules and checkpoints.

`MegatronBackend` implements megatron.backend.TrainingBackend with get_model + get_megatron_optimizer, the
forward/backward schedule of the pipeline size (1F1B, interleaved, or none), gradient finalisation, the
--check-for-nan-in-loss-and-grad skip, megatron/checkpoint/'s save/load, the fp16 grad scaler's loss scale and
calc_params_l2_norm.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from megatron import global_vars
from megatron.backend.base import StepResult, TrainingBackend
from megatron.checkpoint.loading import last_loaded, read_checkpoint
from megatron.checkpoint.saving import save_run_checkpoint
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.errors import MegatronUserError
from megatron.logging_utils import print_rank_0
from megatron.model_setup import build_model, build_param_scheduler, record_run_length
from megatron.nan_guard import (
    NonFiniteTrainingError,
    loaded_state_problem,
    local_grad_norm,
    loss_and_grads_finite,
)
from megatron.optimizer import get_megatron_optimizer
from megatron.rerun_state_machine import RerunMode, RerunStateMachine
from megatron.run_configs.step import StepSettings
from megatron.training_state import TrainingState
from megatron.utils import calc_params_l2_norm

if TYPE_CHECKING:
    from megatron.run_configs.bundle import RunConfigs


class PipelineScheduleError(MegatronUserError):
    """The batch layout does not fit the pipeline schedule."""


def check_pipeline_schedule(step: StepSettings, num_microbatches: int) -> None:
    """Megatron's start-up rule for the interleaved schedule: micro-batches divisible by the pipeline size."""
    pp = step.pipeline_model_parallel_size
    if pp > 1 and step.virtual_pipeline_model_parallel_size is not None \
            and num_microbatches % pp != 0:
        raise PipelineScheduleError(
            f"the interleaved pipeline schedule (--num-layers-per-virtual-pipeline-stage) needs the number of "
            f"micro-batches ({num_microbatches} = --global-batch-size / (--micro-batch-size x data-parallel "
            f"size)) to be divisible by --pipeline-model-parallel-size ({pp}); change --global-batch-size or "
            f"--micro-batch-size")


def _schedule(step: StepSettings) -> Callable[..., list]:
    check_pipeline_schedule(step, global_vars.get_num_microbatches())
    return get_forward_backward_func(step.pipeline_model_parallel_size, step.virtual_pipeline_model_parallel_size)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if (
        torch.cuda.is_available() and torch.distributed.is_initialized()
        and torch.distributed.get_backend() == "nccl") else torch.device("cpu")


def reduce_logged_losses(losses_reduced: list, state: ps.ParallelState, sums: bool = False) -> dict:
    """The logged value of each named loss over one global batch's micro-batch dicts: the mean of the micro-batch
    values, or for Megatron's [sum, count] pairs (--calculate-per-token-loss) the sums over the micro-batches and
    the data-parallel-with-CP group divided (`sums`: the pair (sum, count) as a tuple, for evaluation to add up)."""
    out: dict = {}
    for key in losses_reduced[0]:
        values = [x[key] for x in losses_reduced]
        if isinstance(values[0], torch.Tensor) and values[0].numel() == 2:
            pair = torch.stack([v.detach().reshape(2).double() for v in values]).sum(dim=0).to(_device())
            if state.dp_cp_group is not None and torch.distributed.is_initialized() \
                    and torch.distributed.get_world_size(state.dp_cp_group) > 1:
                torch.distributed.all_reduce(pair, group=state.dp_cp_group)
            total, count = float(pair[0]), float(pair[1])
            out[key] = (total, count) if sums else total / count
        else:
            out[key] = sum(float(v) for v in values) / len(values)
    return out


def _add_eval_losses(total: dict, loss_dicts: list, state: ps.ParallelState) -> None:
    """Add one evaluation iteration's micro-batch values to `total`: floats summed one by one (divided by the
    micro-batches at the end), [sum, count] pairs summed as a pair (divided by the count at the end)."""
    if not loss_dicts:
        return
    first = next(iter(loss_dicts[0].values()))
    if isinstance(first, torch.Tensor) and first.numel() == 2:
        for key, (part, count) in reduce_logged_losses(loss_dicts, state, sums=True).items():
            previous = total.get(key, (0.0, 0.0))
            total[key] = (previous[0] + part, previous[1] + count)
        return
    for d in loss_dicts:
        for key, value in d.items():
            total[key] = total.get(key, 0.0) + float(value)


def _finalize(model: list, state: ps.ParallelState, step: StepSettings, num_tokens: Optional[torch.Tensor]) -> None:
    """The gradients' data-parallel (and pipeline-embedding, sequence-parallel) reductions, timed."""
    timers = global_vars.get_timers()
    timers("grads-all-reduce", log_level=1).start(barrier=step.barrier_with_L1_time)
    finalize_model_grads(model, state, sequence_parallel=step.sequence_parallel,
                         num_tokens=None if num_tokens is None else num_tokens.to(_device()))
    timers("grads-all-reduce").stop()


SPIKY_LOSS_FACTOR = 10  # Megatron's: a loss 10x the largest seen is spiky (and grads likewise)


def validate_loss(machine: RerunStateMachine, loss: torch.Tensor, configs: RunConfigs) -> None:
    """Megatron's loss checks of one micro-batch's local loss (pretrain_gpt.py loss_func): NaN and Inf (fatal, with
    --check-for-nan-in-loss-and-grad), spiky (not fatal, --check-for-spiky-loss)."""
    if configs.step.check_for_nan_in_loss_and_grad:
        machine.validate_result(loss, torch.isnan, "found NaN in local forward loss calculation", tolerance=0.0,
                                fatal=True)
        machine.validate_result(loss, torch.isinf, "found Inf in local forward loss calculation", tolerance=0.0,
                                fatal=True)
    if configs.settings.value("check_for_spiky_loss"):
        machine.validate_result(
            loss, functools.partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
            "Spiky loss", tolerance=0.0, fatal=False)


def validate_local_grads(machine: RerunStateMachine, model: list, configs: RunConfigs) -> None:
    """Megatron's checks of this rank's grad norm before the data-parallel reduction: NaN and Inf (fatal, with
    --check-for-nan-in-loss-and-grad; not with --fp16, whose loss scaler handles overflows), unexpectedly large (not
    fatal, --check-for-large-grads); 0.1% tolerance between runs, as Megatron."""
    nan_check = configs.step.check_for_nan_in_loss_and_grad and not configs.model_wrap.fp16
    large_check = configs.settings.value("check_for_large_grads")
    if not (nan_check or large_check):
        return
    norm = local_grad_norm(model)
    where = "in backward pass before data-parallel communication collective"
    if nan_check:
        machine.validate_result(norm, torch.isnan, f"found NaN in local grad norm {where}", tolerance=0.001,
                                fatal=True)
        machine.validate_result(norm, torch.isinf, f"found Inf in local grad norm {where}", tolerance=0.001,
                                fatal=True)
    if large_check:
        machine.validate_result(
            norm, functools.partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="grads"),
            f"found unexpected large grads {where}", tolerance=0.001, fatal=False)


def validated_forward_step(forward_step_func: Callable, machine: RerunStateMachine, configs: RunConfigs) -> Callable:
    """`forward_step_func` whose loss function's loss (each micro-batch's, before any reduction) goes through
    `validate_loss`."""
    @functools.wraps(forward_step_func)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        output_tensor, loss_func = forward_step_func(*args, **kwargs)

        def checked_loss_func(*largs: Any, **lkwargs: Any) -> Any:
            out = loss_func(*largs, **lkwargs)
            if not lkwargs.get("non_loss_data") and isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
                validate_loss(machine, out[0].detach(), configs)
            return out
        return output_tensor, checked_loss_func
    return forward_step


class MegatronBackend(TrainingBackend):
    """Megatron's own path (see the module docstring)."""

    name = "megatron"

    def setup(self, model_provider: Callable, model_type: Any, configs: RunConfigs,
              state: ps.ParallelState) -> tuple[list, Any, Any]:
        model = build_model(model_provider, model_type, configs.model_wrap, state, configs.transformer)
        optimizer = get_megatron_optimizer(model, configs.optimizer, state)
        record_run_length(configs.flags)  # Megatron's builder writes the run's length onto args here
        return model, optimizer, build_param_scheduler(optimizer, configs.schedule)

    def load(self, model: list, optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
             train_state: TrainingState) -> int:
        timers = global_vars.get_timers()
        timers("load-checkpoint", log_level=0).start(barrier=True)
        iteration = read_checkpoint(model, optimizer, opt_param_scheduler, configs.checkpoint, configs.architecture,
                                    train_state)
        timers("load-checkpoint").stop(barrier=True)
        timers.log(["load-checkpoint"])
        loaded = last_loaded()
        problem = loaded_state_problem(model, optimizer) if loaded is not None else None
        if problem is not None:
            raise NonFiniteTrainingError(f"the checkpoint loaded from --load ({loaded.folder}) holds non-finite "
                                         f"{problem}: training cannot continue from it (a lower --lr will not help); "
                                         "resume from an earlier checkpoint (edit latest_checkpointed_iteration.txt) "
                                         "or start without --load")
        return iteration

    def train_step(self, forward_step_func: Callable, data_iterator: Optional[Iterator], model: list,
                   optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
                   state: ps.ParallelState) -> StepResult:
        timers = global_vars.get_timers()
        step, batch = configs.step, configs.batch
        forward_backward_func = _schedule(step)
        # --rerun-mode: the forward-backward runs again while the rerun state machine asks (megatron/
        # rerun_state_machine.py); disabled, it runs once and no check goes through the machine
        machine = global_vars.get_rerun_state_machine()
        checked = machine.mode != RerunMode.DISABLED
        if checked:
            forward_step_func = validated_forward_step(forward_step_func, machine, configs)
        while machine.should_run_forward_backward(data_iterator):
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            # --calculate-per-token-loss: the schedule sums the micro-batches' token counts here (Megatron's rule)
            num_tokens = torch.zeros((), dtype=torch.long) if step.calculate_per_token_loss else None
            timers("forward-backward", log_level=1).start(barrier=step.barrier_with_L1_time)
            losses_reduced = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=global_vars.get_num_microbatches(), forward_only=False,
                grad_scale_func=optimizer.scale_loss, seq_length=batch.seq_length,
                micro_batch_size=batch.micro_batch_size, decoder_seq_length=step.decoder_seq_length,
                parallel_state=state, calculate_per_token_loss=bool(step.calculate_per_token_loss),
                num_tokens=num_tokens,
            )
            timers("forward-backward").stop()
            if checked:  # each run's grads are checked, then reduced (with --overlap-grad-reduce the buckets were
                # reduced during the backward: checked after the reduction)
                overlapped = any(getattr(chunk, "overlap_grad_reduce", False) for chunk in model)
                if not overlapped:
                    validate_local_grads(machine, model, configs)
                _finalize(model, state, step, num_tokens)
                if overlapped:
                    validate_local_grads(machine, model, configs)
        if machine.should_checkpoint_and_exit()[1]:  # the loop saves (if asked) and exits with the machine's code
            return {}, 0, None, None
        if not checked:
            _finalize(model, state, step, num_tokens)

        # --check-for-nan-in-loss-and-grad: a non-finite loss or grad norm skips the step on every rank (nan_guard).
        finite = True
        if step.check_for_nan_in_loss_and_grad:
            finite, _ = loss_and_grads_finite(losses_reduced, model, check_grads=not configs.model_wrap.fp16)
        timers("optimizer", log_level=1).start(barrier=step.barrier_with_L1_time)
        if finite:
            update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
        else:
            update_successful, grad_norm, num_zeros_in_grad = False, float("nan"), None
        timers("optimizer").stop()

        if update_successful:
            increment = global_vars.get_num_microbatches() * batch.micro_batch_size * batch.data_parallel_size
            opt_param_scheduler.step(increment=increment)
            skipped_iter = 0
        else:
            skipped_iter = 1

        if state.is_pipeline_last_stage(ignore_virtual=True) and losses_reduced:
            return reduce_logged_losses(losses_reduced, state), skipped_iter, grad_norm, num_zeros_in_grad
        return {}, skipped_iter, grad_norm, num_zeros_in_grad

    def evaluate(self, forward_step_func: Callable, data_iterator: Optional[Iterator], model: list,
                 process_non_loss_data_func: Optional[Callable], configs: RunConfigs, state: ps.ParallelState,
                 verbose: bool, count_valid_samples: bool, counts: Any) -> tuple[dict, Any]:
        for chunk in model:
            chunk.eval()
        total: dict[str, float] = {}
        step, batch = configs.step, configs.batch
        forward_backward_func = _schedule(step)
        num_mb = global_vars.get_num_microbatches()
        with torch.no_grad():
            for it in range(batch.eval_iters):
                if verbose:
                    print_rank_0(f"Evaluating iter {it + 1}/{batch.eval_iters}")
                loss_dicts = forward_backward_func(
                    forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                    num_microbatches=num_mb, forward_only=True, seq_length=batch.seq_length,
                    micro_batch_size=batch.micro_batch_size, parallel_state=state,
                    decoder_seq_length=step.decoder_seq_length)
                if state.is_pipeline_last_stage(ignore_virtual=True):
                    _add_eval_losses(total, loss_dicts, state)
                if count_valid_samples:
                    counts.consumed_valid_samples += batch.micro_batch_size * batch.data_parallel_size * num_mb
            collected = None
            if process_non_loss_data_func is not None:  # every stage takes part in the pipelined forward
                collected = forward_backward_func(
                    forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                    num_microbatches=num_mb, forward_only=True, collect_non_loss_data=True, seq_length=batch.seq_length,
                    micro_batch_size=batch.micro_batch_size, parallel_state=state,
                    decoder_seq_length=step.decoder_seq_length)
        for chunk in model:
            chunk.train()
        for key in total:
            total[key] = (total[key][0] / total[key][1] if isinstance(total[key], tuple)
                          else total[key] / (batch.eval_iters * num_mb))
        return total, collected

    def save(self, iteration: int, model: list, optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
             train_loss: Optional[float], train_state: TrainingState, sign: bool = True) -> None:
        save_run_checkpoint(iteration, model, optimizer, opt_param_scheduler, configs, train_state, train_loss,
                            sign=sign)

    def loss_scale(self, model: list, optimizer: Any) -> float:
        return float(optimizer.get_loss_scale().item())

    def params_norm(self, model: list, state: ps.ParallelState) -> float:
        for chunk in model:  # --overlap-param-gather: params must be complete
            getattr(chunk, "finish_param_sync", lambda: None)()
        return calc_params_l2_norm(model, state.mp_group, state.tp_rank)
