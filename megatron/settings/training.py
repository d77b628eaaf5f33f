"""Training-loop settings: batch and schedule, recomputation, fusions, initialization, validation."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, ClassVar, List, Optional

from megatron.settings.declare import ConfigField, extra_flag, setting


def _bias_gelu_fusion(args: argparse.Namespace) -> Any:
    return args.bias_gelu_fusion and not args.onnx_safe  # Megatron's --onnx-safe MLP: erf GeLU, no fused bias-GeLU


_NO_MONITOR = ("configures nvidia-resiliency-ext's monitor process and heartbeats, which this in-process restart does not use (a failing rank closes its connections, the others fail at once and restart)")
_RESTORE_BIAS_GELU_FUSION = (("bias_gelu_fusion", lambda v: v), ("onnx_safe", lambda v: None))


def _init_method(args: argparse.Namespace) -> Any:
    import torch  # lazily: the flag layer is imported by the preprocessing tools, which never load torch
    return torch.nn.init.xavier_uniform_ if args.init_method_xavier_uniform else None


@dataclasses.dataclass
class TrainingSettings:
    """--help group "training"."""

    TITLE: ClassVar[str] = "training"
    micro_batch_size: Optional[int] = setting("--micro-batch-size", help="Batch size per model instance (local).",
        read_by="megatron/training.py")
    batch_size: Optional[int] = setting("--batch-size", help="Deprecated: use --micro-batch-size.",
        read_by="megatron/arguments.py")
    global_batch_size: Optional[int] = setting("--global-batch-size",
        help="Training batch size across all data-parallel ranks (default micro-batch-size * DP).",
        read_by="megatron/microbatches.py")
    rampup_batch_size: Optional[List[str]] = setting("--rampup-batch-size", nargs="*",
        help="Batch-size ramp-up: <start batch size> <increment> <ramp-up samples>.", read_by="megatron/global_vars.py")
    checkpoint_activations: bool = setting("--checkpoint-activations", default=False,
        help="Megatron-DeepSpeed: full activation recomputation (uniform method).", feeds=("recompute_granularity",))
    recompute_activations: bool = setting("--recompute-activations", default=False,
        help="Selective activation recomputation (attention core only).", feeds=("recompute_granularity",))
    recompute_granularity: Optional[str] = setting("--recompute-granularity", choices=["full", "selective"],
        help="Activation recomputation granularity.", config=True)
    distribute_saved_activations: bool = setting("--distribute-saved-activations", default=False,
        help="Shard recomputation checkpoints across the tensor-parallel group.", config=True)
    recompute_method: Optional[str] = setting("--recompute-method", choices=["uniform", "block"],
        help="Full recomputation: 'uniform' chunks or the first N layers per stage ('block').", config=True)
    recompute_num_layers: int = setting("--recompute-num-layers", default=1, help="Layers per recomputation unit.",
        config=True)
    checkpoint_num_layers: Optional[int] = setting("--checkpoint-num-layers",
        help="Megatron-DeepSpeed alias of --recompute-num-layers.", feeds=("recompute_num_layers",))
    train_iters: Optional[int] = setting("--train-iters", help="Total training iterations.",
        read_by="megatron/training.py")
    train_samples: Optional[int] = setting("--train-samples", help="Total training samples.",
        read_by="megatron/training.py")
    log_interval: int = setting("--log-interval", default=100, help="Report loss and timing every N iterations.",
        read_by="megatron/training.py")
    log_args: bool = setting("--log-args", default=False,
        help="Print Megatron's full argument dump on a terminal too (a redirected log always has it; on a terminal "
             "one summary line is printed instead).", read_by="megatron/arguments.py")
    exit_interval: Optional[int] = setting("--exit-interval", help="Exit when iteration %% N == 0.",
        read_by="megatron/training.py")
    exit_duration_in_mins: Optional[int] = setting("--exit-duration-in-mins", help="Exit after this many minutes.",
        read_by="megatron/training.py")
    exit_signal_handler: bool = setting("--exit-signal-handler", default=False, help="Save and exit on SIGTERM.",
        read_by="megatron/training.py")
    check_for_nan_in_loss_and_grad: bool = setting("--check-for-nan-in-loss-and-grad", default=True,
        action="store_true",
        also=(extra_flag("--no-check-for-nan-in-loss-and-grad", action="store_false",
                         help="Do not check the loss and grad norm for nan/inf before the optimizer step."),),
        help="Skip (and count) an iteration whose loss or grad norm is not finite (default on).",
        read_by="megatron/backend/megatron.py")
    calculate_per_token_loss: bool = setting("--calculate-per-token-loss", default=False, action="store_true",
        help="Loss = sum of the token losses over the number of loss tokens of the whole global batch (all "
             "micro-batches and data-parallel ranks) instead of the mean of the micro-batches' means; grads divided "
             "by that token count (Megatron-LM's rule).", read_by="megatron/backend/megatron.py")
    max_skipped_iterations: int = setting("--max-skipped-iterations", default=10,
        help="Stop with an error after this many consecutive skipped non-finite iterations (0: never).",
        read_by="megatron/training.py")
    tensorboard_dir: Optional[str] = setting("--tensorboard-dir", help="Tensorboard log directory.",
        read_by="megatron/global_vars.py")
    masked_softmax_fusion: bool = setting("--no-masked-softmax-fusion", default=True,
        help="Do not fuse scaling, masking and softmax.", config=True)
    bias_gelu_fusion: bool = setting("--no-bias-gelu-fusion", default=True, help="Do not fuse bias add and GeLU.",
        config=ConfigField(compute=_bias_gelu_fusion, arch=11, kept=14, hint="--no-bias-gelu-fusion (or not)",
        restore=_RESTORE_BIAS_GELU_FUSION))
    bias_swiglu_fusion: bool = setting("--no-bias-swiglu-fusion", default=True,
        help="Do not fuse bias add and SwiGLU (the Triton kernel on CUDA).", config=True)
    bias_dropout_fusion: bool = setting("--no-bias-dropout-fusion", default=True,
        help="Do not fuse bias add, dropout and residual add.", config=True)
    use_flash_attn: bool = setting("--use-flash-attn", default=False, help="FlashAttention (CUDA only).", config=True)
    optimizer: str = setting("--optimizer", optimizer_config=True, default="adam", choices=["adam", "sgd", "muon", "dist_muon"],
        help="Optimizer (muon: Muon for 2-D weights, Adam for the rest; dist_muon: the same, layer-wise distributed "
             "over data parallel).",
        read_by="megatron/optimizer/__init__.py")
    dataloader_type: Optional[str] = setting("--dataloader-type", choices=["single", "cyclic"],
        help="Data sampler ('single' by default).", read_by="megatron/training.py")
    async_tensor_model_parallel_allreduce: bool = setting("--no-async-tensor-model-parallel-allreduce", default=True,
        help="Do not overlap the tensor-parallel all-reduce with the weight-gradient computation.", config=True)
    no_persist_layer_norm: bool = setting("--no-persist-layer-norm", default=False,
        help="Do not use persistent layer-norm kernels.",
        variant="picks apex's non-persistent LayerNorm kernel; this build's LayerNorm is torch's, or on CUDA the "
                "Triton one (megatron/fused_kernels/norms.py) for every hidden size")
    sequence_parallel: bool = setting("--sequence-parallel", default=False,
        help="Megatron sequence parallelism (needs TP > 1).", config=True)
    gradient_accumulation_fusion: bool = setting("--no-gradient-accumulation-fusion", default=True,
        help="Do not fuse weight-gradient accumulation (needs a CUDA extension).", config=True)
    deterministic_mode: bool = setting("--deterministic-mode", default=False, help="Choose deterministic algorithms.",
        config=True)
    empty_unused_memory_level: int = setting("--empty-unused-memory-level", default=0, choices=[0, 1, 2],
        help="Call torch.cuda.empty_cache() each iteration (0 off, 1 moderate, 2 aggressive).",
        read_by="megatron/training.py")
    skip_train: bool = setting("--skip-train", default=False, help="Skip training; only evaluate.",
        read_by="megatron/training.py")
    inprocess_restart: bool = setting("--inprocess-restart", default=False,
        help="Restart training inside the same processes (from the latest checkpoint) when any rank raises.",
        read_by="megatron/inprocess_restart.py")
    inprocess_max_iterations: Optional[int] = setting("--inprocess-max-iterations",
        help="At most this many in-process restarts (default: no limit).", read_by="megatron/inprocess_restart.py")
    inprocess_barrier_timeout: float = setting("--inprocess-barrier-timeout", default=120.0,
        help="Seconds every rank waits for the others at a restart's barrier.", read_by="megatron/inprocess_restart.py")
    inprocess_completion_timeout: float = setting("--inprocess-completion-timeout", default=120.0,
        help="Seconds every rank waits for the others to finish (or restart) at the end.", read_by="megatron/inprocess_restart.py")
    inprocess_empty_cuda_cache: bool = setting("--inprocess-empty-cuda-cache", default=False,
        help="Release cached GPU memory at every in-process restart.", read_by="megatron/inprocess_restart.py")
    inprocess_active_world_size: Optional[int] = setting("--inprocess-active-world-size",
        help="Ranks executing the workload (warm reserve ranks are not supported: only the world size).",
        read_by="megatron/inprocess_restart.py")
    inprocess_granularity: str = setting("--inprocess-granularity", default="node", choices=["node", "rank"],
        help="Granularity of the restart (every rank of the job restarts here).",
        refused="'rank' needs nvidia-resiliency-ext's rank reassignment; every rank of the job restarts here")
    inprocess_monitor_thread_interval: float = setting("--inprocess-monitor-thread-interval", default=1.0,
        help="nvidia-resiliency-ext's monitor setting (not used here).", refused=_NO_MONITOR)
    inprocess_monitor_process_interval: float = setting("--inprocess-monitor-process-interval", default=1.0,
        help="nvidia-resiliency-ext's monitor setting (not used here).", refused=_NO_MONITOR)
    inprocess_progress_watchdog_interval: float = setting("--inprocess-progress-watchdog-interval", default=1.0,
        help="nvidia-resiliency-ext's monitor setting (not used here).", refused=_NO_MONITOR)
    inprocess_heartbeat_interval: float = setting("--inprocess-heartbeat-interval", default=30.0,
        help="nvidia-resiliency-ext's monitor setting (not used here).", refused=_NO_MONITOR)
    inprocess_soft_timeout: float = setting("--inprocess-soft-timeout", default=60.0,
        help="nvidia-resiliency-ext's monitor setting (not used here).", refused=_NO_MONITOR)
    inprocess_hard_timeout: float = setting("--inprocess-hard-timeout", default=90.0,
        help="nvidia-resiliency-ext's monitor setting (not used here).", refused=_NO_MONITOR)
    inprocess_heartbeat_timeout: float = setting("--inprocess-heartbeat-timeout", default=60.0,
        help="nvidia-resiliency-ext's monitor setting (not used here).", refused=_NO_MONITOR)
    inprocess_last_call_wait: float = setting("--inprocess-last-call-wait", default=1.0,
        help="nvidia-resiliency-ext's monitor setting (not used here).", refused=_NO_MONITOR)
    inprocess_termination_grace_time: float = setting("--inprocess-termination-grace-time", default=1.0,
        help="nvidia-resiliency-ext's monitor setting (not used here).", refused=_NO_MONITOR)
    # Megatron-LM's rerun state machine (megatron/rerun_state_machine.py); off by default here (0.16.1:
    # validate_results), so that existing runs do not change
    rerun_mode: str = setting("--rerun-mode", default="disabled",
        choices=["disabled", "validate_results", "report_determinism_stats"],
        help="Re-run a step whose result a check rejects to tell a transient error from a persistent one "
             "(validate_results), or re-run every step to report its non-determinism (report_determinism_stats).",
        read_by="megatron/rerun_state_machine.py")
    check_for_spiky_loss: bool = setting("--check-for-spiky-loss", default=False, action="store_true",
        help="With --rerun-mode validate_results: a loss over 10x the largest of the first 100 losses is re-run "
             "(not fatal).", read_by="megatron/backend/megatron.py")
    check_for_large_grads: bool = setting("--check-for-large-grads", default=False, action="store_true",
        help="With --rerun-mode validate_results: a local grad norm over 10x the largest of the first 100 is "
             "re-run (not fatal).", read_by="megatron/backend/megatron.py")
    error_injection_rate: int = setting("--error-injection-rate", default=0,
        help="Make about one result validation in N fail (0: never), to test the rerun state machine.",
        read_by="megatron/rerun_state_machine.py")
    error_injection_type: str = setting("--error-injection-type", default="transient_error",
        choices=["correct_result", "transient_error", "persistent_error"],
        help="What an injected failure looks like when its step is re-run.",
        read_by="megatron/rerun_state_machine.py")
    iterations_to_skip: Optional[List[int]] = setting("--iterations-to-skip", nargs="+", type=int,
        help="Skip these iterations (counted from 0): their micro-batches are read and dropped, the model is not "
             "stepped (Megatron-LM's; --result-rejected-tracker-filename adds the iterations it names twice).",
        read_by="megatron/training.py")
    result_rejected_tracker_filename: Optional[str] = setting("--result-rejected-tracker-filename",
        help="Append every rejected result and its re-runs' diagnostics to this file (Megatron's line format).",
        read_by="megatron/rerun_state_machine.py")


@dataclasses.dataclass
class InitializationSettings:
    """--help group "initialization"."""

    TITLE: ClassVar[str] = "initialization"
    seed: int = setting("--seed", default=1234, help="Random seed (python, numpy, torch).",
        read_by="megatron/initialize.py")
    data_parallel_random_init: bool = setting("--data-parallel-random-init", default=False,
        help="Different initial weights on each data-parallel rank.", read_by="megatron/initialize.py")
    init_method_std: float = setting("--init-method-std", default=0.02, help="Std of the normal weight initialiser.",
        config=True)
    init_method_xavier_uniform: bool = setting("--init-method-xavier-uniform", default=False,
        help="Xavier uniform initialisation.", config=(ConfigField("init_method", compute=_init_method),
        ConfigField("output_layer_init_method", compute=_init_method)))


@dataclasses.dataclass
class ValidationSettings:
    """--help group "validation"."""

    TITLE: ClassVar[str] = "validation"
    eval_iters: int = setting("--eval-iters", default=100, help="Iterations per validation/test evaluation.",
        read_by="megatron/training.py")
    eval_interval: int = setting("--eval-interval", default=1000, help="Iterations between validation runs.",
        read_by="megatron/training.py")
