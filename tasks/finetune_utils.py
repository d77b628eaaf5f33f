"""The finetuning loop (Megatron's tasks/finetune_utils.py) on pretrain()'s machinery.

Model, optimizer, scheduler and --load come from megatron.training.setup_model_and_optimizer; steps, the log line,
the --eval-interval loss evaluation and checkpoint saves are training.py's. What is finetuning's own:
  * epochs over a data-parallel DistributedSampler (set_epoch(--seed + epoch), drop_last unless --keep-last);
    train_iters = epochs x batches per epoch, so warmup/decay fractions apply to the whole run;
  * --pretrained-checkpoint loaded only at iteration 0, model only (no optimizer/RNG; missing head/pooler noticed);
  * --load resumes exactly: epoch and batch from the iteration, the sampler order replayed, the RNG restored;
  * a checkpoint at each epoch end (and every --save-interval), then the accuracy lines (tasks/eval_utils.py);
  * --epochs 0 evaluates only and writes the predictions (Megatron crashes there).
Loss: cross entropy of the logits, logged under ``lm loss`` as Megatron does. The run state (iteration, epoch,
consumed samples) is a `FinetuneState` (tasks/finetune_state.py), never written onto the parsed flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from megatron import global_vars
from megatron.checkpoint import async_save
from megatron.checkpoint.paths import get_checkpoint_tracker_filename
from megatron.checkpoint.rng import local_rng_state, restore_local_rng_state
from megatron.compat import load_checkpoint
from megatron.core import parallel_state as ps
from megatron.errors import ArgumentError
from megatron.layers import ModelType
from megatron.rerun_state_machine import refuse_outside_pretrain
from megatron.run_configs.bundle import RunConfigs
from megatron.training import (
    evaluate_and_print_results,
    print_datetime,
    save_unless_diverging,
    setup_model_and_optimizer,
    train_step,
    training_log,
)
from megatron.utils import average_losses_across_data_parallel_group, print_rank_0
from tasks.eval_utils import batch_tensors, evaluate_datasets
from tasks.finetune_state import FinetuneState


@dataclasses.dataclass
class FinetuneTask:
    """What a task provides: its datasets from paths, its model (``model_provider(config, pre_process,
    post_process)`` with the run's TransformerConfig, ``configs.transformer``), and its submission-file writer."""
    name: str
    build_dataset: Callable[[list[str]], Any]
    model_provider: Callable[..., torch.nn.Module]
    write_predictions: Optional[Callable[[str, Any, list], None]] = None


def _loss_func(labels: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = F.cross_entropy(logits.float(), labels)
    averaged = average_losses_across_data_parallel_group([loss])
    return loss, {"lm loss": averaged[0]}


def _forward_step(args: argparse.Namespace, data_iterator: Any, model: torch.nn.Module) -> tuple[Any, Callable]:
    timers = global_vars.get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, padding_mask, labels = batch_tensors(next(data_iterator), args)
    timers("batch-generator").stop()
    return model(tokens, padding_mask, tokentype_ids=types), partial(_loss_func, labels)


def _train_loader(dataset: Any, args: argparse.Namespace, state: ps.ParallelState) -> Any:
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=state.dp_size,
                                                              rank=state.dp_rank, shuffle=True)
    return torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch_size, sampler=sampler,
                                       drop_last=not args.keep_last, num_workers=0)


def _check_batch(args: argparse.Namespace) -> None:
    if args.global_batch_size != args.micro_batch_size * args.data_parallel_size:
        raise ArgumentError(f"finetuning runs one micro-batch per step: --global-batch-size "
                            f"({args.global_batch_size}) must equal --micro-batch-size x data-parallel size "
                            f"({args.micro_batch_size * args.data_parallel_size}); drop --global-batch-size")
    if args.rampup_batch_size is not None:
        raise ArgumentError("--rampup-batch-size is not supported by finetuning: drop it")
    if args.keep_last and args.pipeline_model_parallel_size > 1:
        raise ArgumentError("--keep-last with --pipeline-model-parallel-size > 1: the pipeline needs full "
                            "micro-batches; drop --keep-last")
    if getattr(args, "deepspeed", False):
        raise ArgumentError("--deepspeed is not supported by the finetuning tasks yet: drop it (TP/PP/DP and "
                            "--use-distributed-optimizer work)")
    if not args.bert_binary_head:
        raise ArgumentError("--bert-no-binary-head: the finetuning heads always use the pooler and token types "
                            "(a checkpoint pretrained without them loads with a fresh pooler); drop it")
    for dest, default in (("mask_prob", 0.15), ("short_seq_prob", 0.1)):
        if getattr(args, dest, default) != default:
            raise ArgumentError(f"--{dest.replace('_', '-')} is a pretraining setting; finetuning does not use it: "
                                "drop it")


def _load_pretrained(model: list, optimizer: Any, args: argparse.Namespace) -> None:
    tracker = get_checkpoint_tracker_filename(args.pretrained_checkpoint)
    if not os.path.isfile(tracker):
        raise ArgumentError(f"--pretrained-checkpoint {args.pretrained_checkpoint}: no checkpoint there ({tracker} is "
                            "missing); pass the --save directory of pretrain_bert.py")
    saved = (args.finetune, args.no_load_rng, args.no_load_optim)
    args.finetune, args.no_load_rng, args.no_load_optim = True, True, True
    try:
        load_checkpoint(model, optimizer, None, args, load_arg="pretrained_checkpoint", strict=True)
    finally:
        args.finetune, args.no_load_rng, args.no_load_optim = saved


def _prediction_writer(task: FinetuneTask, args: argparse.Namespace) -> Optional[Callable[[Any, list], None]]:
    if task.write_predictions is None:
        return None
    out_dir = args.save
    if not out_dir:
        print_rank_0(" > predictions are not written: pass --save DIR to get the submission files")
        return None

    def write(dataset: Any, preds: list) -> None:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        os.makedirs(out_dir, exist_ok=True)
        path = task.write_predictions(out_dir, dataset, preds)
        print_rank_0(f" > predictions for {dataset.dataset_name} written to {path}")

    return write


def finetune(task: FinetuneTask, args: argparse.Namespace) -> dict:
    """Train for --epochs (0: evaluate only). Returns {"train_losses": {it: {...}}, "valid_losses": {it: {...}},
    "accuracy": {epoch: {name: (correct, total)}}, "iteration"} with the numbers the log, validation and accuracy
    lines print. The run keeps its own copy of the flags (batch sizes count sequences, the LR schedule's length is
    the epochs'): the args start-up assembled stay as they are (megatron/startup.py)."""
    args = argparse.Namespace(**vars(args))
    state = ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()
    _check_batch(args)
    epochs = int(args.epochs or 0)
    if epochs < 0:
        raise ArgumentError(f"--epochs {epochs}: pass 0 (evaluate only) or more")
    print_rank_0(f"> building {task.name} datasets ...")
    train_ds = None
    if epochs > 0:
        if not args.train_data:
            raise ArgumentError(f"--task {task.name} --epochs {epochs} needs --train-data (or --epochs 0 to evaluate)")
        train_ds = task.build_dataset(args.train_data)
    valid_sets = [task.build_dataset([p]) for p in (args.valid_data or [])]
    if epochs == 0 and not valid_sets:
        raise ArgumentError("--epochs 0 evaluates only: pass --valid-data")
    if epochs == 0:  # evaluation never runs on random weights
        if not (args.load or args.pretrained_checkpoint or args.allow_random_weights):
            raise ArgumentError("--epochs 0 evaluates a finetuned model: pass --load (a finetuning --save directory), "
                                "or --allow-random-weights to evaluate an untrained model")
        if args.load and not args.pretrained_checkpoint:
            from megatron.text_generation.model_loading import require_checkpoint

            require_checkpoint(args.load)
    multiplier = getattr(train_ds if train_ds is not None else valid_sets[0], "sample_multiplier", 1)

    rng = local_rng_state()
    loader = _train_loader(train_ds, args, state) if train_ds is not None else None
    restore_local_rng_state(rng)
    iters_per_epoch = len(loader) if loader is not None else 0
    if epochs > 0 and iters_per_epoch == 0:
        raise ArgumentError(f"--train-data has {len(train_ds)} examples, fewer than one batch of "
                            f"{args.micro_batch_size * state.dp_size}: lower --micro-batch-size or pass --keep-last")
    args.train_iters = max(1, epochs * iters_per_epoch)  # the LR schedule's length (never stepped with 0 epochs)
    print_rank_0(f" > training iterations per epoch: {iters_per_epoch}, total: {epochs * iters_per_epoch}")
    eval_batch = args.micro_batch_size
    # Batch sizes count sequences from here on (a RACE question is `multiplier` of them), as Megatron does: the
    # pipeline's activation shape, the LR schedule's sample counts and the consumed samples follow them.
    args.orig_micro_batch_size, args.orig_global_batch_size = args.micro_batch_size, args.global_batch_size
    args.micro_batch_size *= multiplier
    args.global_batch_size *= multiplier

    if epochs == 0:  # evaluation only: --load gives the weights; no optimizer, schedule or RNG to restore
        args.no_load_optim, args.no_load_rng = True, True
    run = FinetuneState(padded_vocab_size=getattr(args, "padded_vocab_size", None))
    configs = RunConfigs.from_args(args)  # the run's records, after the batch sizes above became sequences
    refuse_outside_pretrain(configs.settings, "tasks/ finetuning")  # --rerun-mode and its flags (one line)
    model, optimizer, scheduler = setup_model_and_optimizer(partial(task.model_provider, configs.transformer),
                                                            ModelType.encoder_or_decoder,
                                                            configs, state, run)
    if run.iteration == 0 and args.pretrained_checkpoint:
        _load_pretrained(model, optimizer, args)
    result: dict = {"train_losses": {}, "valid_losses": {}, "accuracy": {}, "iteration": run.iteration}

    if epochs == 0:
        result["accuracy"][-1] = evaluate_datasets(valid_sets, model, args, state, -1, eval_batch,
                                                   _prediction_writer(task, args))
        return result

    valid_it = None
    if valid_sets and args.eval_interval and args.eval_iters:
        # Megatron's padded DistributedSampler: every DP rank gets ceil(n / dp) examples (the first ones repeated),
        # so all ranks have the same number of batches and take part in the same loss all-reduces (a rank with
        # fewer batches than the others would hang them).
        concat = torch.utils.data.ConcatDataset(valid_sets)
        sampler = torch.utils.data.distributed.DistributedSampler(concat, num_replicas=state.dp_size,
                                                                  rank=state.dp_rank, shuffle=False)
        vloader = torch.utils.data.DataLoader(concat, batch_size=eval_batch, sampler=sampler, drop_last=True)
        valid_it = _cycle(vloader) if len(vloader) else None
        if valid_it is None:
            print_rank_0(f" > no --eval-interval validation loss: {len(concat)} validation example(s) give no full "
                         f"batch of {eval_batch} per data-parallel rank (the accuracy is still computed)")
    run.do_valid = valid_it is not None

    timers = global_vars.get_timers()
    for chunk in model:
        chunk.train()
    iteration = run.iteration
    start_epoch, start_batch = divmod(iteration, iters_per_epoch)
    total_loss_dict: dict = {}
    report_memory_flag = True
    forward_step = partial(_forward_step, args)
    timers("interval-time", log_level=0).start(barrier=True)
    print_datetime("before the start of training step")
    for epoch in range(start_epoch, epochs):
        run.epoch = epoch
        print_rank_0(f"working on epoch {epoch} ...")
        loader.sampler.set_epoch(args.seed + epoch)
        rng = local_rng_state()
        batches = iter(loader)
        restore_local_rng_state(rng)
        for index, batch in enumerate(batches):
            if epoch == start_epoch and index < start_batch:
                continue  # resume: these batches were trained before the checkpoint
            # (the iteration of the previous step, 0 for a run's first: what Megatron's loop left on args)
            loss_dict, skipped, grad_norm, num_zeros = train_step(forward_step, iter([batch]), model, optimizer,
                                                                  scheduler, configs, state, run.curr_iteration or 0)
            iteration = run.step(args.global_batch_size, args.seq_length)
            result["train_losses"][iteration] = {k: float(v) for k, v in loss_dict.items()}
            report_memory_flag = training_log(loss_dict, total_loss_dict, optimizer.param_groups[0]["lr"],
                                              iteration, float(optimizer.get_loss_scale().item()),
                                              report_memory_flag, skipped, grad_norm, None, num_zeros, configs, run)
            if valid_it is not None and iteration % args.eval_interval == 0:
                valid = evaluate_and_print_results(f"iteration {iteration}", forward_step, valid_it, model,
                                                   iteration, None, configs, state, train_state=run)
                result["valid_losses"][iteration] = {k: float(v) for k, v in valid.items()}
            saved = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
            if saved:
                save_unless_diverging(iteration, model, optimizer, scheduler, configs, run)
            if getattr(args, "exit_interval", None) and iteration % args.exit_interval == 0:
                if args.save and not saved:
                    save_unless_diverging(iteration, model, optimizer, scheduler, configs, run)
                print_datetime(f"exiting program at iteration {iteration}")
                result["iteration"] = iteration
                async_save.maybe_finalize(blocking=True)  # --async-save: the exit's save is published first
                return result
        if args.save and not (args.save_interval and iteration % args.save_interval == 0):
            save_unless_diverging(iteration, model, optimizer, scheduler, configs, run)  # the end of every epoch
        result["accuracy"][epoch] = evaluate_datasets(valid_sets, model, args, state, epoch, eval_batch)
    result["iteration"] = iteration
    async_save.maybe_finalize(blocking=True)
    return result


def _cycle(loader: Any) -> Any:
    while True:
        yield from loader
