"""The ``--deepspeed`` training path: build the DeepSpeed engine, run train/eval steps, save and load checkpoints.

`setup_deepspeed_model_and_optimizer` builds the model it is given (GPTModel, or GPTModelPipe under pipeline
parallelism: megatron/backend/deepspeed.py chooses), Megatron's parameter groups and a torch AdamW/SGD (so no
DeepSpeed op needs compiling), and hands them to ``deepspeed.initialize`` with the reconciled config (`megatron.ds.config`) and our `mpu` adapter. DeepSpeed
then owns precision (fp16/bf16 from the config), gradient accumulation, data-parallel reduction, ZeRO partitioning
and gradient clipping; Megatron's `OptimizerParamScheduler` still sets LR and weight decay, stepped by the samples
of each applied update exactly like the non-DeepSpeed path.

Checkpoints are DeepSpeed's (``<save>/global_step{N}/``, ``<save>/latest``) with Megatron's bookkeeping in the
client state: ``iteration``, ``args`` (consumed samples inside), ``checkpoint_version``, ``rng_state`` and
``opt_param_scheduler``.

DeepSpeed is imported on first use (megatron.optional), so importing this module stays cheap.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from megatron import global_vars, optional
from megatron.checkpoint import integrity
from megatron.checkpoint.args import compare_architecture, saved_architecture
from megatron.checkpoint.atomic_io import DiskFullError, is_disk_full
from megatron.checkpoint.paths import CHECKPOINT_VERSION, CheckpointError, first_failure_reason
from megatron.checkpoint.rng import get_rng_state, set_rng_state
from megatron.checkpoint.safe_load import guarded_torch_load
from megatron.checkpoint.selection import check_checkpoint_layout
from megatron.core import aux_losses
from megatron.core import parallel_state as ps
from megatron.core.step_updates import apply_step_updates
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.ds.engine_kind import is_pipe_engine
from megatron.ds.mpu import get_mpu
from megatron.ds.pipe import pipe_eval_step, pipe_train_step
from megatron.ds.weights import (
    expected_layout,
    is_megatron_checkpoint,
    load_megatron_checkpoint_into_engine,
    load_other_layout_into_engine,
    tag_layout_or_none,
)
from megatron.logging_utils import print_rank_0
from megatron.models.gpt.model_pipe import ensure_deepspeed_comm
from megatron.optimizer import get_param_groups
from megatron.optimizer.clip_grads import get_grad_norm_fp32, grads_for_norm
from megatron.optimizer.optimizer_config import OptimizerConfig
from megatron.run_configs.batch import BatchSettings
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.run_configs.deepspeed import DeepSpeedSettings
from megatron.training_state import TrainingState
from megatron.utils import calc_params_l2_norm

# DeepSpeed picks the CPU accelerator on a machine without CUDA anyway, after logging a WARNING that it could not
# detect one; naming its choice beforehand (unless DS_ACCELERATOR is set) keeps CPU runs free of that alarm.
if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"


# ----------------------------------------------------------------------------------------------- helpers
def _build_torch_optimizer(model: torch.nn.Module, opt: OptimizerConfig) -> torch.optim.Optimizer:
    """Megatron's parameter groups (wd_mult/lr_mult) in a torch AdamW (decoupled weight decay) or SGD."""
    groups = get_param_groups(model)
    if not groups:
        raise ValueError("--deepspeed: the model has no trainable parameters")
    for group in groups:
        group["lr"] = opt.lr * group["lr_mult"]
        group["weight_decay"] = opt.weight_decay * group["wd_mult"]
    if opt.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=opt.lr, weight_decay=opt.weight_decay,
                                 betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
    if opt.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=opt.lr, weight_decay=opt.weight_decay, momentum=opt.sgd_momentum)
    raise ValueError(f"--optimizer {opt.optimizer!r} is not supported; use 'adam' or 'sgd'")


def _engine_config(settings: DeepSpeedSettings) -> dict:
    """The reconciled config (megatron.ds.config, in the settings) with our optimizer's and log's additions."""
    if not settings.config_dict:
        raise ValueError("--deepspeed: no reconciled DeepSpeed config in the settings (validate_args reconciles "
                         "--deepspeed_config with the flags: megatron.ds.config)")
    config = dict(settings.config_dict)
    if "optimizer" not in config:
        # Our torch optimizer goes to ZeRO (DeepSpeed only "tests" its own) and may be combined with offload.
        config.setdefault("zero_allow_untested_optimizer", True)
        config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("steps_per_print", 10**9)  # Megatron prints its own log line
    return config


def configure_activation_checkpointing(settings: DeepSpeedSettings, state: ps.ParallelState) -> None:
    """--deepspeed-activation-checkpointing: configure DeepSpeed's checkpointing and route our recompute to it.

    DeepSpeed's CheckpointFunction saves/restores the CPU and accelerator RNG and the states of
    ``deepspeed.checkpointing.get_cuda_rng_tracker()``; we make that tracker *our* model-parallel RNG tracker so
    dropout inside tensor-parallel regions replays the forward's masks during recomputation.
    """
    ds_ckpt = optional.deepspeed("runtime.activation_checkpointing.checkpointing")
    ds = settings
    ensure_deepspeed_comm()  # configure() calls deepspeed.comm before deepspeed.initialize would set it up
    optional.deepspeed().checkpointing.configure(
        get_mpu(state),
        partition_activations=ds.partition_activations,
        contiguous_checkpointing=ds.contigious_checkpointing,
        num_checkpoints=ds.num_layers,
        checkpoint_in_cpu=ds.checkpoint_in_cpu,
        synchronize=ds.synchronize_each_layer,
        profile=ds.profile_backward,
    )
    ds_ckpt._CUDA_RNG_STATE_TRACKER = tp_random.get_rng_tracker()
    tp_random.set_checkpoint_function(_deepspeed_checkpoint)


def _deepspeed_checkpoint(function: Callable, *inputs: Any) -> Any:
    """deepspeed.checkpointing.checkpoint over the tensor inputs only (non-tensors such as a missing encoder
    output are bound here: DeepSpeed's partitioned path pairs every saved input with its size)."""
    positions = [i for i, x in enumerate(inputs) if torch.is_tensor(x)]
    fixed = list(inputs)

    def run(*tensors: torch.Tensor) -> Any:
        full = list(fixed)
        for i, t in zip(positions, tensors):
            full[i] = t
        return function(*full)

    return optional.deepspeed().checkpointing.checkpoint(run, *[inputs[i] for i in positions])


# ----------------------------------------------------------------------------------------------- set-up
def _skip_inference_only_cpu_op() -> None:
    """On CPU, DeepSpeed's comm backend JIT-compiles a shared-memory op (about a minute on a cold cache) that only
    DeepSpeed-Inference's all-reduce uses; training never calls it, so mark it unavailable (DS_BUILD_SHM_COMM=1
    keeps it)."""
    if optional.deepspeed("accelerator").get_accelerator().device_name() != "cpu" or \
            os.environ.get("DS_BUILD_SHM_COMM") == "1":
        return
    if optional.deepspeed("comm.comm").cdb is None:  # the backend (and the op) is built at the first comm init
        optional.deepspeed("ops").__compatible_ops__["deepspeed_shm_comm"] = False


def setup_deepspeed_model_and_optimizer(model_provider: Callable, model_type: Any, settings: DeepSpeedSettings,
                                        optimizer_config: OptimizerConfig, state: ps.ParallelState,
                                        make_scheduler: Callable[[Any], Any]) -> tuple[list, Any, Any]:
    """([engine], engine's optimizer, the LR/WD scheduler `make_scheduler` builds over the engine's optimizer);
    `model_provider` builds the module the engine wraps (the DeepSpeed backend passes the family's pipe model under
    DeepSpeed's pipeline engine)."""
    _skip_inference_only_cpu_op()
    if settings.deepspeed_activation_checkpointing:
        configure_activation_checkpointing(settings, state)
    model = model_provider(pre_process=True, post_process=True)
    model.model_type = model_type
    for param in model.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if state.dp_rank == 0:
        n_params = sum(p.nelement() for p in model.parameters())
        print(f" > number of parameters on (tensor, pipeline) model parallel rank ({state.tp_rank}, "
              f"{state.pp_rank}): {n_params}", flush=True)

    for param in model.parameters():  # Megatron's expert mark reads as DeepSpeed's own MoE mark (which needs a
        if getattr(param, "allreduce", True) is False:  # group_name); expert parallelism is refused under
            del param.allreduce  # DeepSpeed, so the experts are ordinary data-parallel params here
    optimizer = _build_torch_optimizer(model, optimizer_config)
    pipe = type(model).__name__ == "GPTModelPipe" or _is_pipeline_module(model)
    engine, ds_optimizer, _, _ = optional.deepspeed().initialize(
        model=model, optimizer=optimizer, config=_engine_config(settings),
        mpu=None if pipe else get_mpu(state), dist_init_required=False,
    )
    # The scheduler drives the engine optimizer's groups (ZeRO keeps our group dicts, flattening their params).
    opt_param_scheduler = make_scheduler(ds_optimizer)
    return [engine], ds_optimizer, opt_param_scheduler


def _is_pipeline_module(model: Any) -> bool:
    try:
        pipe = optional.deepspeed("pipe")
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, pipe.PipelineModule)


# ----------------------------------------------------------------------------------------------- steps
def _sync_batch_size(engine: Any, batch: BatchSettings) -> int:
    """Follow --rampup-batch-size: the engine's gradient accumulation = Megatron's number of micro-batches."""
    num_mb = global_vars.get_num_microbatches()
    if engine.gradient_accumulation_steps() != num_mb:
        engine.set_train_batch_size(num_mb * batch.micro_batch_size * batch.data_parallel_size)
    return num_mb


def _reduce_loss_dicts(dicts: list[dict]) -> dict:
    out: dict = {}
    if not dicts:
        return out
    for key in dicts[0]:
        values = [float(d[key]) for d in dicts]
        out[key] = sum(values) / len(values)
    return out


def _grad_norm(engine: Any) -> Optional[float]:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)


def deepspeed_train_step(forward_step_func: Callable, data_iterator: Optional[Iterator], model: list, optimizer: Any,
                         opt_param_scheduler: Any, settings: DeepSpeedSettings, batch: BatchSettings,
                         state: ps.ParallelState) -> tuple[dict, int, Optional[float], Optional[int]]:
    """One iteration through the engine: (loss_dict, skipped_iter, grad_norm, num_zeros_in_grad)."""
    engine = model[0]
    num_mb = _sync_batch_size(engine, batch)
    increment = num_mb * batch.micro_batch_size * batch.data_parallel_size
    if is_pipe_engine(engine):
        loss_dict, skipped, grad_norm, num_zeros = pipe_train_step(engine, data_iterator, settings, state)
        if not skipped:
            opt_param_scheduler.step(increment=increment)
        return loss_dict, skipped, grad_norm, num_zeros

    timers = global_vars.get_timers()
    barrier = settings.barrier_with_L1_time
    losses = []
    # MoE router losses get the main loss's backward scale (engine.backward divides by the accumulation steps).
    aux_losses.set_aux_loss_scale(deepspeed_loss_scale(model) / num_mb)
    timers("forward-backward", log_level=1).start(barrier=barrier)
    for i in range(num_mb):
        # Explicit boundary: DeepSpeed's own test ((micro_steps + 1) % gas) drifts once the ramp-up changes gas.
        engine.set_gradient_accumulation_boundary(i == num_mb - 1)
        output, loss_func = forward_step_func(data_iterator, engine)
        loss, loss_dict = loss_func(output)
        engine.backward(loss)
        losses.append(loss_dict)
        if i < num_mb - 1:
            engine.step()  # not a boundary: only DeepSpeed's micro-step bookkeeping
    timers("forward-backward").stop()
    # Without ZeRO or a precision wrapper DeepSpeed clips but does not keep the norm: take it from the reduced grads.
    plain_norm = _plain_grad_norm(engine, state) if _is_plain_optimizer(engine) else None
    apply_step_updates(model, (state.tp_group, state.dp_cp_group))  # as finalize_model_grads (the expert bias)
    timers("optimizer", log_level=1).start(barrier=barrier)
    engine.step()
    timers("optimizer").stop()

    applied = bool(engine.was_step_applied()) if hasattr(engine, "was_step_applied") else True
    if applied:
        opt_param_scheduler.step(increment=increment)
    grad_norm = _grad_norm(engine)
    return _reduce_loss_dicts(losses), 0 if applied else 1, grad_norm if grad_norm is not None else plain_norm, None


def _is_plain_optimizer(engine: Any) -> bool:
    return isinstance(engine.optimizer, torch.optim.Optimizer) and not engine.zero_optimization()


def _plain_grad_norm(engine: Any, state: ps.ParallelState) -> float:
    return float(get_grad_norm_fp32(grads_for_norm(engine.module.parameters(), state.tp_rank), state.mp_group))


def deepspeed_forward_only(forward_step_func: Callable, data_iterator: Optional[Iterator], engine: Any,
                           num_microbatches: int, settings: DeepSpeedSettings, state: ps.ParallelState) -> list[dict]:
    """Loss dicts of `num_microbatches` forward passes (no grad)."""
    if is_pipe_engine(engine):
        return [pipe_eval_step(engine, data_iterator, settings, state)]
    out = []
    with torch.no_grad():
        for _ in range(num_microbatches):
            output, loss_func = forward_step_func(data_iterator, engine)
            _, loss_dict = loss_func(output)
            out.append({k: float(v) for k, v in loss_dict.items()})
    return out


def deepspeed_evaluate(forward_step_func: Callable, data_iterator: Optional[Iterator], model: list,
                       settings: DeepSpeedSettings, batch: BatchSettings, state: ps.ParallelState, counts: Any,
                       verbose: bool = False, count_valid_samples: bool = True) -> dict:
    """training.evaluate for engines: average losses over --eval-iters batches; validation samples are counted in
    `counts` (the run state: ``consumed_valid_samples``)."""
    engine = model[0]
    engine.eval()
    num_mb = global_vars.get_num_microbatches()
    total: dict[str, float] = {}
    count = 0
    for it in range(batch.eval_iters):
        if verbose:
            print_rank_0(f"Evaluating iter {it + 1}/{batch.eval_iters}")
        dicts = deepspeed_forward_only(forward_step_func, data_iterator, engine, num_mb, settings, state)
        for d in dicts:
            for key, value in d.items():
                total[key] = total.get(key, 0.0) + float(value)
        count += len(dicts)
        if count_valid_samples:
            counts.consumed_valid_samples += batch.micro_batch_size * batch.data_parallel_size * num_mb
    engine.train()
    return {k: v / max(1, count) for k, v in total.items()}


def deepspeed_loss_scale(model: list) -> float:
    """The engine's current loss scale (1.0 in fp32/bf16)."""
    optimizer = getattr(model[0], "optimizer", None)
    for attr in ("cur_scale", "loss_scale"):
        value = getattr(optimizer, attr, None)
        if value is not None and not callable(value):
            return float(value.item() if isinstance(value, torch.Tensor) else value)
    return 1.0


def deepspeed_params_norm(model: list, state: ps.ParallelState) -> float:
    """calc_params_l2_norm over the engine's module (ZeRO-3 parameters gathered first)."""
    engine = model[0]
    module = engine.module
    if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:
        params = list(module.parameters())
        with optional.deepspeed().zero.GatheredParameters(params, modifier_rank=None):
            return calc_params_l2_norm([module], state.mp_group, state.tp_rank)
    return calc_params_l2_norm([module], state.mp_group, state.tp_rank)


# ----------------------------------------------------------------------------------------------- checkpoints
def checkpoint_tag(iteration: int) -> str:
    return f"global_step{iteration}"


def _engine_save(engine: Any, save_dir: str, tag_dir: str, iteration: int, client_state: dict) -> None:
    """engine.save_checkpoint; a full disk (DeepSpeed writes with torch.save) is one line, not torch's traceback."""
    try:
        engine.save_checkpoint(save_dir, tag=checkpoint_tag(iteration), client_state=client_state)
    except (OSError, RuntimeError) as exc:
        folder = tag_dir if os.path.isdir(tag_dir) else save_dir
        if is_disk_full(exc, folder):
            raise DiskFullError(f"no space left on the device holding {folder} while DeepSpeed saved iteration "
                                f"{iteration}: free space or save somewhere else; `latest` still names the previous "
                                "checkpoint (the unfinished folder has no manifest and is skipped on load)") from None
        raise


def save_deepspeed_checkpoint(iteration: int, model: list, optimizer: Any, opt_param_scheduler: Any,
                              cfg: CheckpointSettings, architecture: Mapping[str, Any],
                              saved_args: argparse.Namespace, run: TrainingState, sign: bool = True) -> None:
    """engine.save_checkpoint(<save>, tag=global_step{N}) with Megatron's state in client_state (collective):
    `saved_args` as Megatron's ``args``, `architecture` as ours, `run`'s counters under Megatron's keys;
    `sign=False`: no manifest.json (and no pruning, which needs a verified newest tag)."""
    del optimizer  # saved by the engine
    engine = model[0]
    save_dir = cfg.save
    if not save_dir:
        raise CheckpointError("saving a DeepSpeed checkpoint needs --save DIR")
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save_dir}")
    counters = run.checkpoint_counters()
    client_state: dict[str, Any] = {
        "iteration": iteration,
        "args": saved_args,
        "architecture": dict(architecture),
        "checkpoint_version": CHECKPOINT_VERSION,
        **{k: counters[k] for k in ("consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens")},
        **run.checkpoint_totals(),
    }
    if not cfg.no_save_rng:
        client_state["rng_state"] = get_rng_state()  # gathered over data-parallel ranks: every rank calls
    if opt_param_scheduler is not None and not cfg.no_save_optim:
        client_state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    tag_dir = integrity.iteration_dir(save_dir, iteration, "deepspeed")
    if cfg.rank == 0:  # crashed writes' temp files go; a rewritten tag must not verify until its manifest exists
        integrity.prepare_save(save_dir, tag_dir, print_rank_0)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    _engine_save(engine, save_dir, tag_dir, iteration, client_state)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if cfg.rank == 0 and sign:  # manifest last; DeepSpeed already moved `latest` (an unverified tag loads with a note)
        integrity.write_manifest(tag_dir)
        integrity.prune_after_save(save_dir, iteration, cfg.keep_last_n_checkpoints, print_rank_0,
                                   layout="deepspeed")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir}")


def load_deepspeed_checkpoint(model: list, optimizer: Any, opt_param_scheduler: Any, cfg: CheckpointSettings,
                              architecture: Mapping[str, Any], train_state: TrainingState) -> int:
    """Resume from ``<load>/latest`` (DeepSpeed layout); returns the iteration (0 with --finetune or none found).
    The checkpoint must match this run's parallel sizes (`cfg`) and `architecture`; the consumed samples go to
    `train_state` (weights from another layout are padded to the architecture's ``padded_vocab_size``)."""
    del optimizer  # restored by the engine
    engine = model[0]
    load_dir = cfg.load
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        if cfg.exit_on_missing_checkpoint:
            raise CheckpointError(f"--exit-on-missing-checkpoint: no DeepSpeed checkpoint ({latest}) in --load "
                                  f"{load_dir}")
        if is_megatron_checkpoint(load_dir):  # --finetune (or --no-load-optim --no-load-rng): weights only
            return load_megatron_checkpoint_into_engine(engine, architecture, ps.get_parallel_state(), train_state,
                                                        cfg)
        print_rank_0(f" no DeepSpeed checkpoint in {load_dir} yet ({os.path.basename(latest)} not found): will not "
                     "load any checkpoints and will start from random")
        return 0
    finetune = cfg.finetune
    load_optim = not finetune and not cfg.no_load_optim
    try:  # the newest global_stepN whose files match their manifest
        latest_tag = integrity.read_pointer_file(latest)
        tag = integrity.select_deepspeed_tag(load_dir, latest_tag, not cfg.no_checkpoint_fallback, first_failure_reason, print_rank_0)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    tag_dir = os.path.join(load_dir, tag)
    layout = tag_layout_or_none(tag_dir)
    streamed = layout is not None and layout != expected_layout(engine)
    if streamed:  # e.g. --to-deepspeed output under ZeRO-3: module weights, then partitioned
        if load_optim:
            raise CheckpointError(f"{tag_dir} was written by a {layout} engine and this run uses a "
                                  f"{expected_layout(engine)} one: its optimizer state does not load here; pass "
                                  "--no-load-optim (and --no-load-rng), or --finetune, to start from its weights")
        path, client_state = load_other_layout_into_engine(engine, tag_dir, architecture,
                                                           architecture["padded_vocab_size"], ps.get_parallel_state(),
                                                           cfg)
    else:
        with guarded_torch_load(trust=cfg.trust_checkpoint):  # DeepSpeed's torch.load
            path, client_state = engine.load_checkpoint(
                load_dir, tag=tag, load_optimizer_states=load_optim, load_lr_scheduler_states=False,
                load_module_only=finetune)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load the checkpoint named by {latest}; check that the "
                              "global_step folder exists and matches this run's parallel layout")
    client_state = client_state or {}
    ckpt_args = client_state.get("args")
    if streamed:  # another TP/PP layout is fine here: the architecture must match
        saved = saved_architecture(client_state.get("architecture"), ckpt_args)
        compare_architecture({k: v for k, v in saved.items() if k != "padded_vocab_size"}, architecture, path)
    elif ckpt_args is not None or client_state.get("architecture"):
        check_checkpoint_layout(ckpt_args, cfg, architecture, path, client_state.get("architecture"))
    loaded_iteration = int(client_state.get("iteration", 0))
    if finetune:
        iteration = 0
    else:
        iteration = loaded_iteration
        names = ("consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens")
        train_state.restore_counters(client_state, ckpt_args, names)
    if load_optim and opt_param_scheduler is not None and "opt_param_scheduler" in client_state:
        opt_param_scheduler.load_state_dict(client_state["opt_param_scheduler"])
    if not finetune and not cfg.no_load_rng:
        if "rng_state" not in client_state:
            raise CheckpointError(f"checkpoint {path} has no rng_state; pass --no-load-rng")
        set_rng_state(client_state["rng_state"])
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    restart = "" if iteration == loaded_iteration else f"; training starts at iteration {iteration} (--finetune)"
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} at iteration {loaded_iteration}{restart}")
    return iteration
