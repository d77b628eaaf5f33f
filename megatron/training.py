"""Megatron's pretraining driver: ``pretrain(dataset_provider, model_provider, model_type, forward_step_func)``.

Initialises Megatron (flags, torch.distributed, model-parallel groups, seeds, tokenizer), builds the model
(mixed-precision wrapper, local or torch DDP over the data-parallel group), the optimizer and the LR/WD schedule
(in samples, converted from iterations as Megatron does), loads a checkpoint, builds the data iterators at the
consumed-sample position and runs the training loop with Megatron's logging, evaluation, checkpointing and exit
conditions (--exit-interval, --exit-duration-in-mins, --exit-signal-handler).

The loop owns the run state (a `TrainingState`: iteration, consumed samples, ...; megatron/training_state.py) and
drives one training backend (megatron/backend/: Megatron's own or DeepSpeed's engine, picked by `backend_for`) for
set-up, load, steps, evaluation, saves, loss scale and parameter norm; it has no DeepSpeed branches.

Entry scripts may pass ``argv`` (a list of flag strings) instead of reading ``sys.argv``; tests use that.
"""
from __future__ import annotations

import math
import sys
import time
from datetime import datetime
from typing import Any, Callable, Iterator, Optional

import torch

from megatron import global_vars, peer_failure
from megatron.backend import backend_for
from megatron.backend.megatron import PipelineScheduleError, check_pipeline_schedule  # noqa: F401  (Megatron's names)
from megatron.checkpoint import async_save
from megatron.checkpoint.loading import forget_last_loaded, last_loaded
from megatron.checkpoint.rng import local_rng_state, restore_local_rng_state
from megatron.core import aux_losses
from megatron.core import parallel_state as ps
from megatron.data.data_checks import check_data_prefixes, check_train_split
from megatron.data.data_samplers import build_pretraining_data_loader
from megatron.flops import bert_num_floating_point_operations, num_floating_point_operations
from megatron.initialize import initialize_megatron
from megatron.inprocess_restart import InProcessRestart
from megatron.logging_utils import (
    ADVANCED,
    NAN,
    SKIPPED,
    accumulate_losses,
    format_training_log_line,
    log_validation,
    print_rank_0,
    print_rank_last,
    report_memory,
    write_train_scalars,
)

# get_model and the scheduler setup live below training (megatron/model_setup.py, shared with megatron/ds/engine.py);
# re-exported here under their Megatron names.
from megatron.model_setup import (  # noqa: F401
    get_model,
    get_optimizer_param_scheduler,
    update_train_iters,
)
from megatron.models.t5.model import t5_num_floating_point_operations
from megatron.nan_guard import (
    FirstLossWatch,
    NonFiniteTrainingError,
    SkipCounter,
    params_finite,
)
from megatron.progress import Heartbeat, ProgressNotes
from megatron.rerun_state_machine import (
    RerunDataIterator,
    RerunMode,
    RerunStateMachine,
    iterations_to_skip_from_tracker,
    machine_for_run,
)
from megatron.run_configs.bundle import RunConfigs
from megatron.run_configs.run_settings import LoopSettings
from megatron.settings.required_flags import TRAINING_RUN
from megatron.straggler import StragglerDetector
from megatron.theoretical_memory_usage import memory_report
from megatron.training_state import TrainingState

_TRAIN_START_TIME = time.time()
# A line every 30 s of wall time while pretrain() runs (started and stopped there), naming the phase: start-up, model
# and checkpoint loading, dataset index building, training, evaluation, checkpoint saves.
HEARTBEAT = Heartbeat()


def print_datetime(message: str) -> None:
    """Megatron's ``[message] datetime: …`` line (rank 0, after a barrier)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    print_rank_0(f"[{message}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')} ")


# ----------------------------------------------------------------------------------------------- model + optimizer
def setup_model_and_optimizer(model_provider_func: Callable, model_type: Any, configs: RunConfigs,
                              state: ps.ParallelState, train_state: TrainingState) -> tuple[list, Any, Any]:
    """Model, optimizer and LR schedule from the backend; loads --load (the iteration and consumed samples go to
    `train_state`)."""
    forget_last_loaded()
    configs.flags.model_type = model_type  # Megatron records it in args (saved in every checkpoint)
    backend = backend_for(configs)
    model, optimizer, opt_param_scheduler = backend.setup(model_provider_func, model_type, configs, state)
    train_state.iteration = backend.load(model, optimizer, opt_param_scheduler, configs, train_state) \
        if configs.checkpoint.load is not None else 0
    return model, optimizer, opt_param_scheduler


# ----------------------------------------------------------------------------------------------- data
def _cyclic_iter(loader: Any) -> Iterator:
    while True:
        yield from loader


def build_train_valid_test_data_iterators(
    dataset_provider: Callable, configs: RunConfigs, state: ps.ParallelState, train_state: TrainingState
) -> tuple[Optional[Iterator], Optional[Iterator], Optional[Iterator]]:
    """Build the datasets (every rank) and the pretraining loaders at the resume point (consumed samples); sets
    `train_state`'s do_train/do_valid/do_test."""
    run, batch, loop = train_state, configs.batch, configs.loop
    print_rank_0("> building train, validation, and test datasets ...")
    if run.iteration > 0 and run.consumed_train_samples == 0:
        if batch.train_samples is not None:
            raise RuntimeError("checkpoint has no consumed_train_samples; cannot resume with --train-samples")
        run.consumed_train_samples = run.iteration * batch.global_batch_size
    if run.iteration > 0 and run.consumed_valid_samples == 0 and batch.train_samples is None:
        run.consumed_valid_samples = (run.iteration // loop.eval_interval) * batch.eval_iters * \
            batch.global_batch_size
    train_samples = batch.train_samples if batch.train_samples else loop.train_iters * batch.global_batch_size
    eval_iters = (loop.train_iters // loop.eval_interval + 1) * batch.eval_iters
    num_samples = [train_samples, eval_iters * batch.global_batch_size, batch.eval_iters * batch.global_batch_size]
    print_rank_0(" > datasets target sizes (minimum size):")
    print_rank_0(f"    train:      {num_samples[0]}")
    print_rank_0(f"    validation: {num_samples[1]}")
    print_rank_0(f"    test:       {num_samples[2]}")

    datasets = dataset_provider(num_samples)  # collective: the provider coordinates cache building
    train_ds, valid_ds, test_ds = datasets
    print_rank_0("> finished creating datasets ...")
    check_train_split(configs.data_files, train_ds)  # an empty training split with --train-iters > 0 is an error

    def loader(ds: Any, consumed: int) -> Any:
        if ds is None:
            return None
        return build_pretraining_data_loader(ds, consumed, batch.micro_batch_size, state.dp_rank, state.dp_size,
                                             batch.num_workers, batch.dataloader_type)

    train_dl = loader(train_ds, run.consumed_train_samples)
    valid_dl = loader(valid_ds, run.consumed_valid_samples)
    test_dl = loader(test_ds, 0)
    run.do_train = train_dl is not None and loop.train_iters > 0
    run.do_valid = valid_dl is not None and batch.eval_iters > 0
    run.do_test = test_dl is not None and batch.eval_iters > 0

    def make_iter(dl: Any) -> Optional[Iterator]:
        if dl is None:
            return None
        return iter(dl) if batch.dataloader_type == "single" else iter(_cyclic_iter(dl))

    return make_iter(train_dl), make_iter(valid_dl), make_iter(test_dl)


# ----------------------------------------------------------------------------------------------- steps
def train_step(forward_step_func: Callable, data_iterator: Optional[Iterator], model: list, optimizer: Any,
               opt_param_scheduler: Any, configs: RunConfigs, state: ps.ParallelState,
               iteration: int) -> tuple[dict, int, Optional[float], Optional[int]]:
    """One iteration through the backend (`iteration`: the one being trained), with the auxiliary losses the model
    declares (named values) added to the losses."""
    loss_dict, skipped_iter, grad_norm, num_zeros = backend_for(configs).train_step(
        forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, configs, state)
    named = named_aux_losses(model, state, iteration)  # collective: every rank
    if loss_dict:
        loss_dict.update(named)
    return loss_dict, skipped_iter, grad_norm, num_zeros


def named_aux_losses(model: list, state: ps.ParallelState, iteration: int) -> dict:
    """This iteration's auxiliary losses, every one the model declares (megatron/core/aux_losses.py), as Megatron-LM
    logs them: their names, the mean over the micro-batches and the recording layers; per-layer values a loss asks
    for go to TensorBoard."""
    values, per_layer = aux_losses.reduce_named_losses(
        aux_losses.declared_by(model), 1.0 / global_vars.get_num_microbatches(), pp_group=state.pp_group,
        dp_group=state.dp_group)
    writer = global_vars.get_tensorboard_writer()
    if writer is not None and per_layer:
        for key, value in per_layer.items():
            writer.add_scalar(key, value, iteration + 1)
    return values


def iteration_flops(configs: RunConfigs, batch_size: int) -> float:
    """One iteration's model FLOPs for the log line's TFLOP/s (the family's formula)."""
    batch = configs.batch
    if configs.log.model_family == "t5":  # encoder-decoder: two sequence lengths
        return t5_num_floating_point_operations(configs.transformer, batch_size, batch.encoder_seq_length,
                                                batch.decoder_seq_length)
    if configs.log.model_family == "bert":  # + LM head dense, pooler and binary head
        return bert_num_floating_point_operations(configs.transformer, batch_size, batch.seq_length,
                                                  batch.bert_binary_head)
    return num_floating_point_operations(configs.transformer, batch_size, batch.seq_length)


def report_stragglers(straggler: Optional[StragglerDetector], iteration: int, configs: RunConfigs,
                      history: Optional[dict]) -> None:
    """Every --log-interval with --log-straggler: every rank's forward time (a collective), the slow ones named in
    the log and in `history["stragglers"][iteration]`."""
    batch = configs.batch
    if straggler is None or iteration % batch.log_interval:
        return
    batch_size = batch.micro_batch_size * batch.data_parallel_size * global_vars.get_num_microbatches()
    report = straggler.report(iteration_flops(configs, batch_size) * batch.log_interval, batch.log_interval)
    if report is not None and history is not None:
        history.setdefault("stragglers", {})[iteration] = report.stragglers


def training_log(loss_dict: dict, total_loss_dict: dict, learning_rate: float, iteration: int, loss_scale: float,
                 report_memory_flag: bool, skipped_iter: int, grad_norm: Optional[float],
                 params_norm: Optional[float], num_zeros_in_grad: Optional[int], configs: RunConfigs,
                 train_state: TrainingState) -> bool:
    """Accumulate losses, write TensorBoard scalars and print the log line every --log-interval (consumed samples
    from `train_state`)."""
    run, batch = train_state, configs.batch
    timers = global_vars.get_timers()
    writer = global_vars.get_tensorboard_writer()
    accumulate_losses(loss_dict, total_loss_dict, skipped_iter)
    if skipped_iter and grad_norm is not None and not math.isfinite(grad_norm) and \
            all(math.isfinite(float(v)) for v in loss_dict.values()):
        total_loss_dict[NAN] += 1  # skipped for a non-finite grad norm (the loss itself was finite)
    batch_size = batch.micro_batch_size * batch.data_parallel_size * global_vars.get_num_microbatches()

    timers_to_log = ["forward-backward", "forward-compute", "backward-compute", "batch-generator",
                     "grads-all-reduce", "optimizer"]
    # Timers gather over all ranks: every rank calls write(), only the writer's rank writes.
    show = configs.log
    if show.log_timers_to_tensorboard and iteration % batch.tensorboard_log_interval == 0:
        timers.write(timers_to_log, writer, iteration, normalizer=1.0)
    if writer is not None and iteration % batch.tensorboard_log_interval == 0:
        write_train_scalars(writer, configs.log, iteration, loss_dict, learning_rate, batch_size, loss_scale, grad_norm,
                            num_zeros_in_grad, params_norm, consumed_samples=run.consumed_train_samples)
        if run.skipped_train_samples > 0:  # --iterations-to-skip (Megatron's scalar)
            writer.add_scalar("skipped-train-samples", run.skipped_train_samples, iteration)

    if iteration % batch.log_interval == 0:
        elapsed = timers("interval-time").elapsed(barrier=True)
        total_iters = total_loss_dict[ADVANCED] + total_loss_dict[SKIPPED]
        per_iter = elapsed / max(1, total_iters)
        if writer is not None and show.log_timers_to_tensorboard:
            writer.add_scalar("iteration-time", per_iter, iteration)
        flops = iteration_flops(configs, batch_size)
        losses = {k: v / float(max(1, total_loss_dict[ADVANCED])) for k, v in total_loss_dict.items()
                  if k not in (ADVANCED, SKIPPED, NAN)}
        if total_loss_dict[ADVANCED] == 0 and total_loss_dict[NAN] > 0:  # print `nan`, do not hide the loss
            losses = {k: float("nan") for k in [*losses, *loss_dict]}
        line = format_training_log_line(
            iteration=iteration, train_iters=configs.loop.train_iters, consumed_samples=int(run.consumed_train_samples),
            consumed_tokens=int(run.consumed_train_tokens), elapsed_per_iter=per_iter,
            learning_rate=learning_rate, batch_size=batch_size, losses=losses, loss_scale=loss_scale,
            grad_norm=grad_norm, num_zeros_in_grad=num_zeros_in_grad, params_norm=params_norm,
            skipped=total_loss_dict[SKIPPED], nans=total_loss_dict[NAN],
            samples_per_sec=batch_size / per_iter if per_iter > 0 else 0.0,
            tflops=flops / (per_iter * batch.world_size * 1e12) if per_iter > 0 else 0.0,
            skipped_samples=int(run.skipped_train_samples),
        )
        print_rank_last(line)
        for key in list(total_loss_dict):
            if key not in (ADVANCED, SKIPPED, NAN):
                total_loss_dict[key] = 0.0
        total_loss_dict[ADVANCED] = total_loss_dict[SKIPPED] = total_loss_dict[NAN] = 0
        if report_memory_flag and skipped_iter == 0:
            report_memory(f"(after {iteration} iterations)")
            report_memory_flag = False
        timers.log(timers_to_log, normalizer=batch.log_interval)
    return report_memory_flag


# ----------------------------------------------------------------------------------------------- evaluation
def evaluate(forward_step_func: Callable, data_iterator: Optional[Iterator], model: list,
             process_non_loss_data_func: Optional[Callable], configs: RunConfigs, state: ps.ParallelState,
             verbose: bool = False, count_valid_samples: bool = True,
             train_state: Optional[TrainingState] = None) -> tuple[dict, Any]:
    """Average the losses over --eval-iters batches (forward only); counts the validation samples in
    `train_state` (required when `count_valid_samples`)."""
    run = train_state
    what = f"evaluation at iteration {run.iteration if run is not None else 0}"
    peer_failure.note_phase(what)
    with HEARTBEAT.phase(what):
        return backend_for(configs).evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func,
                                             configs, state, verbose, count_valid_samples, run)


def evaluate_and_print_results(prefix: str, forward_step_func: Callable, data_iterator: Optional[Iterator],
                               model: list, iteration: int, process_non_loss_data_func: Optional[Callable],
                               configs: RunConfigs, state: ps.ParallelState, verbose: bool = False,
                               count_valid_samples: bool = True, train_state: Optional[TrainingState] = None) -> dict:
    writer = global_vars.get_tensorboard_writer()
    losses, collected = evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, configs, state,
                                 verbose, count_valid_samples, train_state)
    log_validation(prefix, losses, writer, configs.log, iteration, consumed_samples=(
        configs.flags.consumed_train_samples if train_state is None else train_state.consumed_train_samples))
    if process_non_loss_data_func is not None and writer is not None and collected is not None:
        process_non_loss_data_func(collected, iteration, writer)
    return losses


# ----------------------------------------------------------------------------------------------- exit handling
def save_unless_diverging(iteration: int, model: list, optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
          train_state: TrainingState, guard: Optional[SkipCounter] = None, train_loss: Optional[float] = None) -> None:
    """Save a checkpoint, except during a non-finite streak (`guard`): those weights are the ones that diverged.
    While the first losses after loading an unverified checkpoint are still being checked, the save is not signed."""
    if guard is not None and guard.in_streak:
        print_rank_0(f"not saving the checkpoint of iteration {iteration}: the run is in a non-finite streak since "
                     f"iteration {guard.streak_start} (the latest checkpoint stays the one written before it)")
        return
    if not params_finite(model):  # (a ZeRO-3 engine's partitioned parameters are not visible here: not checked)
        raise NonFiniteTrainingError(f"refusing to save the checkpoint of iteration {iteration}: the weights are not "
                                     "finite (the previous checkpoint is left as the latest); lower --lr")
    sign = guard is None or guard.may_sign(iteration)
    if not sign and guard is not None and guard.watch is not None:
        print_rank_0(f"note: the checkpoint of iteration {iteration} is saved without manifest.json (not signed): "
                     f"the run started from {guard.watch.checkpoint}, loaded unverified, and its losses are checked "
                     f"up to iteration {guard.watch.last}; saves from then on are signed")
    peer_failure.note_phase(f"the checkpoint save of iteration {iteration}")
    timers = global_vars.get_timers()
    timers("save-checkpoint", log_level=0).start(barrier=True)
    with HEARTBEAT.phase(f"saving the checkpoint of iteration {iteration}"):
        backend_for(configs).save(iteration, model, optimizer, opt_param_scheduler, configs, train_loss,
                                  train_state, sign=sign)
    timers("save-checkpoint").stop(barrier=True)
    timers.log(["save-checkpoint"])
    if guard is not None:
        guard.checkpoint(iteration, configs.checkpoint.save)


def new_skip_counter(loop: LoopSettings, iteration: int, vocab_size: Optional[int] = None) -> SkipCounter:
    """--max-skipped-iterations, knowing the checkpoint the run started from at `iteration` (named when it diverges
    at once); after an unverified load (no manifest) with the watch on its first losses (`vocab_size`: the padded
    vocabulary, the limit when the checkpoint recorded no loss)."""
    loaded = last_loaded() if loop.load else None
    counter = SkipCounter(loop.max_skipped_iterations,
                          loaded=(iteration, f"iteration {loaded.iteration} in {loop.load}")
                          if loaded is not None else None)
    if loaded is not None and not loaded.verified:  # an unverified checkpoint: its first losses must look sane
        counter.watch = FirstLossWatch(loaded.folder, iteration + 1, loaded.train_loss, vocab_size)
    return counter


def _duration_exceeded(loop: LoopSettings) -> tuple[bool, float]:
    minutes = (time.time() - _TRAIN_START_TIME) / 60.0
    flag = torch.tensor([int(minutes > loop.exit_duration_in_mins)], dtype=torch.int32)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item()), minutes


def train(forward_step_func: Callable, model: list, optimizer: Any, opt_param_scheduler: Any,
          train_data_iterator: Optional[Iterator], valid_data_iterator: Optional[Iterator],
          process_non_loss_data_func: Optional[Callable], configs: RunConfigs, state: ps.ParallelState,
          train_state: TrainingState, history: Optional[dict] = None,
          skip_counter: Optional[SkipCounter] = None) -> tuple[int, bool]:
    """The training loop over `train_state` (the run state) with the run's records `configs`. Returns (last
    iteration, exited_early) — early exits have already saved.
    `history` (pretrain's result) receives ``train_losses[iteration]`` (this rank's reduced losses: the last
    pipeline stage's ranks hold them) and ``valid_losses[iteration]`` of the evaluations during training.
    """
    timers = global_vars.get_timers()
    for chunk in model:
        chunk.train()
    total_loss_dict: dict = {}
    run, loop, batch = train_state, configs.loop, configs.batch
    backend = backend_for(configs)
    iteration = run.iteration
    sigterm = global_vars.get_signal_handler() if loop.exit_signal_handler else None
    timers("interval-time", log_level=0).start(barrier=True)
    print_datetime("before the start of training step")
    report_memory_flag = True
    if skip_counter is None:
        skip_counter = new_skip_counter(loop, iteration, run.padded_vocab_size)
    notes = ProgressNotes(iteration, loop.train_iters, batch.log_interval, print_rank_last, heartbeat=HEARTBEAT)
    straggler = StragglerDetector.for_run(configs.log)  # --log-straggler (None without it)
    step_func = straggler.timed(forward_step_func) if straggler is not None else forward_step_func

    def save() -> None:
        save_unless_diverging(iteration, model, optimizer, opt_param_scheduler, configs, run, skip_counter,
                              skip_counter.last_loss)

    to_skip = iterations_to_skip(configs)
    while iteration < loop.train_iters:
        global_vars.update_num_microbatches(run.consumed_train_samples)
        if iteration in to_skip:  # --iterations-to-skip
            iteration = skip_iteration(train_data_iterator, run, batch)
            continue
        run.curr_iteration = iteration
        peer_failure.note_phase(f"training iteration {iteration + 1}")  # named if a peer is lost (one line)
        loss_dict, skipped_iter, grad_norm, num_zeros = train_step(
            step_func, train_data_iterator, model, optimizer, opt_param_scheduler, configs, state, iteration)
        rerun_exit(global_vars.get_rerun_state_machine(), iteration, run, loop, save, skip_counter)
        if loop.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()  # Megatron's --empty-unused-memory-level (memory only; same numbers)
        iteration += 1
        run.iteration = iteration
        if history is not None:
            history.setdefault("train_losses", {})[iteration] = {k: float(v) for k, v in loss_dict.items()}
        new_samples = batch.data_parallel_size * batch.micro_batch_size * global_vars.get_num_microbatches()
        run.consumed_train_samples += new_samples
        run.consumed_train_tokens += new_samples * batch.seq_length

        loss_scale = backend.loss_scale(model, optimizer)
        params_norm = backend.params_norm(model, state) if loop.log_params_norm else None
        report_memory_flag = training_log(
            loss_dict, total_loss_dict, optimizer.param_groups[0]["lr"], iteration, loss_scale,
            report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros, configs, run)
        report_stragglers(straggler, iteration, configs, history)
        nonfinite = (grad_norm is not None and not math.isfinite(grad_norm)) or \
            any(not math.isfinite(float(v)) for v in loss_dict.values())
        run.skipped_iterations += int(bool(skipped_iter))
        run.nan_iterations += int(nonfinite)
        if skip_counter.watch is not None:
            skip_counter.watch.check(iteration, loss_dict)
        skip_counter.update(iteration, bool(skipped_iter), nonfinite, loss_scale, loop.loss_scale_floor)
        notes.after_iteration(iteration)
        if loss_dict and not nonfinite:
            skip_counter.last_loss = sum(float(v) for v in loss_dict.values())  # recorded in the checkpoints

        if loop.eval_interval and iteration % loop.eval_interval == 0 and run.do_valid:
            losses = evaluate_and_print_results(f"iteration {iteration}", forward_step_func, valid_data_iterator,
                                                model, iteration, process_non_loss_data_func, configs, state,
                                                train_state=run)
            if history is not None:
                history.setdefault("valid_losses", {})[iteration] = losses

        async_save.maybe_finalize(blocking=False)  # --async-save: publish a save every rank has written
        if _save_or_exit(iteration, loop, sigterm, save):
            return iteration, True
    return iteration, False


def iterations_to_skip(configs: RunConfigs) -> set[int]:
    """--iterations-to-skip and the iterations --result-rejected-tracker-filename names (Megatron's rule)."""
    settings = configs.settings
    tracker = settings.value("result_rejected_tracker_filename")
    return set(settings.value("iterations_to_skip") or []) | set(
        iterations_to_skip_from_tracker(tracker) if tracker else [])


def skip_iteration(data_iterator: Optional[Iterator], run: TrainingState, batch: Any) -> int:
    """An iteration of --iterations-to-skip (Megatron's dummy_train_step): its micro-batches are read and dropped
    (every rank reads one per micro-batch, as its forward steps do) inside the rerun state machine's loop, so that
    the machine counts the iteration too (its tracker lines and checkpoint entry name the iterations as the loop
    does), its samples counted as consumed and skipped; no log line, evaluation or save at it (as Megatron). Returns
    the iteration count after it."""
    num_microbatches = global_vars.get_num_microbatches()
    machine = global_vars.get_rerun_state_machine()
    while machine.should_run_forward_backward(data_iterator):
        if data_iterator is not None:
            for _ in range(num_microbatches):
                next(data_iterator)
    samples = batch.data_parallel_size * batch.micro_batch_size * num_microbatches
    run.consumed_train_samples += samples
    run.skipped_train_samples += samples
    run.iteration += 1
    return run.iteration


def rerun_exit(machine: RerunStateMachine, iteration: int, run: TrainingState, loop: Any,
               save: Callable[[], None], guard: SkipCounter) -> None:
    """--rerun-mode validate_results: when the machine asks, save the checkpoint of `iteration` (the steps done; it
    carries the machine's state) and exit with the machine's code (16: resume from it to re-run iteration
    `iteration` + 1; 17: result validation failed). No save during a non-finite streak (`guard`), as at any save."""
    should_checkpoint, should_exit, code = machine.exit_request
    if not should_exit:
        return
    where = ""
    if should_checkpoint and loop.save and guard.in_streak:
        save()  # (prints why it saves nothing)
        where = "; no checkpoint was saved (a non-finite streak): resume from the latest one"
    elif should_checkpoint and loop.save:
        run.rerun_state = machine.checkpoint_state()  # collective
        save()
        run.rerun_state = None
        async_save.maybe_finalize(blocking=True)
        where = f"; the checkpoint of iteration {iteration} in {loop.save} holds the state to resume from"
    elif should_checkpoint:
        where = "; no checkpoint was saved (no --save)"
    what = ("the rejected result was reproduced by re-running it: resume the job (on another node/GPU) to re-run "
            "it from the checkpoint" if code == 16 else
            "result validation failed (the lines above name the check and the diagnostic)")
    print_rank_0(f"rerun state machine: exiting with code {code} at iteration {iteration + 1}: {what}{where}")
    _flush_writer()
    raise SystemExit(code)


def _save_or_exit(iteration: int, loop: Any, sigterm: Any, save: Callable[[], None]) -> bool:
    """Save at --save-interval and before an exit (SIGTERM, --exit-duration-in-mins, --exit-interval); True when the
    loop must exit now."""
    saved = False
    if sigterm is not None and any(sigterm.signals_received()):
        if loop.save:
            save()
        print_datetime("exiting program after receiving SIGTERM.")
        return True
    if loop.save and loop.save_interval and iteration % loop.save_interval == 0:
        save()
        saved = True
    if loop.exit_duration_in_mins:
        done, minutes = _duration_exceeded(loop)
        if done:
            if loop.save and not saved:
                save()
            print_datetime(f"exiting program after {minutes} minutes")
            return True
    if loop.exit_interval and iteration % loop.exit_interval == 0:
        if loop.save and not saved:
            save()
        print_datetime(f"exiting program at iteration {iteration}")
        return True
    return False


# ----------------------------------------------------------------------------------------------- entry point
def pretrain(
    train_valid_test_dataset_provider: Callable,
    model_provider: Callable,
    model_type: Any,
    forward_step_func: Callable,
    process_non_loss_data_func: Optional[Callable] = None,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[dict] = None,
    argv: Optional[list[str]] = None,
    history: Optional[dict] = None,
) -> Optional[dict]:
    """Megatron's ``pretrain``. Returns the numbers the log lines print, for tests and callers to compare:

    ``{"iteration", "train_losses": {iteration: {"lm loss": ...}}, "valid_losses": {iteration: {...}},
    "val_loss", "test_loss", "skipped_iterations", "nan_iterations"}`` (the end-of-training evaluations, None where
    not run; the run's totals of skipped and non-finite iterations, continued from the checkpoint it resumed). Losses
    are the values reduced over data-parallel ranks; only the last pipeline stage's ranks have them (empty dicts
    elsewhere). `history`: the dict to fill and return (filled as the run goes, so a caller can read the losses of a
    run that dies). With --inprocess-restart a failure on any rank restarts the run in every process from the latest
    checkpoint (megatron/inprocess_restart.py).
    """
    restart = InProcessRestart()
    history = {} if history is None else history  # kept across in-process restarts
    return restart.run(lambda: _pretrain_attempt(
        train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, process_non_loss_data_func,
        extra_args_provider, args_defaults, argv, history, restart))


def _pretrain_attempt(train_valid_test_dataset_provider: Callable, model_provider: Callable, model_type: Any,
                      forward_step_func: Callable, process_non_loss_data_func: Optional[Callable],
                      extra_args_provider: Optional[Callable], args_defaults: Optional[dict],
                      argv: Optional[list[str]], history: Optional[dict], restart: InProcessRestart
                      ) -> Optional[dict]:
    """One run of pretrain() (in-process restarts run it again)."""
    global _TRAIN_START_TIME
    with HEARTBEAT.running("starting up (the process group, compiling the dataset index helpers)"):
        args = initialize_megatron(extra_args_provider=extra_args_provider,
                                   args_defaults={**(args_defaults or {}), TRAINING_RUN: True}, args=argv)
        start = torch.tensor([_TRAIN_START_TIME], dtype=torch.float64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(start, op=torch.distributed.ReduceOp.MIN)
        _TRAIN_START_TIME = float(start.item())
        print_rank_0(f"time to initialize megatron (seconds): {time.time() - _TRAIN_START_TIME:.3f}")
        print_datetime("after megatron is initialized")
        state = ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()
        run = TrainingState(padded_vocab_size=getattr(args, "padded_vocab_size", None))
        configs = RunConfigs.from_args(args)  # the run's typed records, built once and passed down
        restart.arm(configs.settings)  # --inprocess-restart: its store (outliving the process groups) on attempt 0
        rerun = machine_for_run(configs.settings, local_rng_state, restore_local_rng_state)  # --rerun-mode
        global_vars.set_rerun_state_machine(rerun)
        check_pipeline_schedule(configs.step, global_vars.get_num_microbatches())
        timers = global_vars.get_timers()
        check_data_prefixes(configs.data_files)  # a mistyped --data-path: one line before the model is built
        timers("model-and-optimizer-setup", log_level=0).start(barrier=True)
        HEARTBEAT.doing("building the model and optimizer (and loading the checkpoint, with --load)")
        model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type, configs, state,
                                                                          run)
        configs = configs.with_run_length()  # the LR schedule's set-up turned --train-samples into --train-iters
        rerun.load_checkpoint_state(run.rerun_state)  # a step to re-run from the checkpoint, if it holds one
        run.rerun_state = None
        rerun.start_at(run.iteration)
        timers("model-and-optimizer-setup").stop()
        print_datetime("after model, optimizer, and learning rate scheduler are built")
        if args.rank == 0 and getattr(model_type, "name", "") == "encoder_or_decoder":  # GPT-shaped models
            memory_report(configs.memory, configs.transformer, num_microbatches=global_vars.get_num_microbatches())

        train_it, valid_it, test_it = _data_iterators(train_valid_test_dataset_provider, configs, state, run, timers)
        if rerun.mode != RerunMode.DISABLED and train_it is not None:
            train_it = RerunDataIterator(train_it)  # a re-run of a step replays its micro-batches
        print_datetime("after dataloaders are built")
        print_rank_0("done with setup ...")
        timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=True)

        result = _initial_result(history, run, restarted=restart.attempt > 0)
        iteration = run.iteration
        loop = configs.loop
        if run.do_train and loop.train_iters > 0 and not loop.skip_train:
            print_rank_0("training ...")
            skip_counter = new_skip_counter(loop, iteration, run.padded_vocab_size)
            iteration, exited = train(forward_step_func, model, optimizer, opt_param_scheduler, train_it, valid_it,
                                      process_non_loss_data_func, configs, state, run, history=result,
                                      skip_counter=skip_counter)
            result.update(iteration=iteration, skipped_iterations=run.skipped_iterations,
                          nan_iterations=run.nan_iterations)
            print_datetime("after training is done")
            if exited:
                async_save.maybe_finalize(blocking=True)  # --async-save: the exit's save is published first
                _flush_writer()
                return result
            if loop.save and iteration != 0 and iteration % loop.save_interval != 0:
                save_unless_diverging(iteration, model, optimizer, opt_param_scheduler, configs, run, skip_counter,
                                      skip_counter.last_loss)
            async_save.maybe_finalize(blocking=True)
        else:
            print_rank_0("skipping training (--skip-train is on) ...")

        _final_evaluations(result, forward_step_func, (valid_it, test_it), model, iteration,
                           process_non_loss_data_func, configs, state, run)
        _flush_writer()
        return result


def _initial_result(history: Optional[dict], run: TrainingState, restarted: bool = False) -> dict:
    """pretrain's result before training: `history` (or a new dict) holding the resumed run's totals (after an
    in-process restart, the earlier attempts' losses up to the iteration it resumed from stay)."""
    result: dict = history if history is not None else {}
    kept = {k: v for k, v in result.get("train_losses", {}).items() if k <= run.iteration} if restarted else {}
    result.update({"iteration": run.iteration, "train_losses": kept, "valid_losses": {}, "val_loss": None,
                   "test_loss": None, "skipped_iterations": run.skipped_iterations,
                   "nan_iterations": run.nan_iterations})
    return result


def _data_iterators(provider: Callable, configs: RunConfigs, state: ps.ParallelState, run: TrainingState,
                    timers: Any) -> tuple:
    """(train, valid, test) iterators from `provider`, timed, with the local RNG state left as it was."""
    timers("train/valid/test-data-iterators-setup", log_level=0).start(barrier=True)
    # Creating DataLoader iterators draws from the global torch RNG; keep the (possibly just restored) RNG state
    # untouched so that resuming from a checkpoint replays exactly the same dropout masks.
    rng = local_rng_state()
    HEARTBEAT.doing("building the datasets (and their index files, on a first run)")
    iterators = build_train_valid_test_data_iterators(provider, configs, state, run)
    restore_local_rng_state(rng)
    timers("train/valid/test-data-iterators-setup").stop()
    return iterators


def _final_evaluations(result: dict, forward_step_func: Callable, iterators: tuple, model: list, iteration: int,
                       process_non_loss_data_func: Optional[Callable], configs: RunConfigs, state: ps.ParallelState,
                       run: TrainingState) -> None:
    """The end-of-training validation and test evaluations into `result` (`val_loss`, `test_loss`)."""
    valid_it, test_it = iterators
    if run.do_valid:
        result["val_loss"] = evaluate_and_print_results(
            "the end of training for val data", forward_step_func, valid_it, model, iteration,
            process_non_loss_data_func, configs, state, verbose=False, train_state=run)
    if run.do_test:
        result["test_loss"] = evaluate_and_print_results(
            "the end of training for test data", forward_step_func, test_it, model, iteration,
            process_non_loss_data_func, configs, state, verbose=True, count_valid_samples=False, train_state=run)


def _flush_writer() -> None:
    writer = global_vars.get_tensorboard_writer()
    if writer is not None:
        writer.flush()
    sys.stdout.flush()


def perplexity(loss: float) -> float:
    """exp(min(20, loss)), Megatron's clamp; nan for a non-finite loss (never a made-up value)."""
    return math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
