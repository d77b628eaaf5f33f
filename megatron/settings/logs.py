"""Logging, timing and tensorboard settings, and the core inference settings."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from megatron.settings.declare import extra_flag, setting

ENGINE = "megatron/inference/config.py"


@dataclasses.dataclass
class LoggingSettings:
    """--help group "logging"."""

    TITLE: ClassVar[str] = "logging"
    log_params_norm: bool = setting("--log-params-norm", default=False, help="Log the L2 norm of the parameters.",
        read_by="megatron/training.py")
    log_num_zeros_in_grad: bool = setting("--log-num-zeros-in-grad", optimizer_config=True, default=False,
        help="Log the number of zeros in the gradient.", read_by="megatron/optimizer/__init__.py")
    timing_log_level: int = setting("--timing-log-level", default=0, choices=range(0, 3),
        help="0: iteration time only; 1: coarse timers; 2: every timer.", read_by="megatron/global_vars.py")
    barrier_with_L1_time: bool = setting("--no-barrier-with-level-1-timing", default=True,
        help="Do not barrier before level-1 timers (times then include load imbalance).",
        read_by="megatron/backend/megatron.py")
    timing_log_option: str = setting("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
        help="How timers are reported across ranks.", read_by="megatron/global_vars.py")
    tensorboard_log_interval: int = setting("--tensorboard-log-interval", default=1,
        help="Tensorboard logging interval.", read_by="megatron/training.py")
    tensorboard_queue_size: int = setting("--tensorboard-queue-size", default=1000,
        help="Tensorboard events queued before a flush to disk.", read_by="megatron/global_vars.py")
    log_timers_to_tensorboard: bool = setting("--log-timers-to-tensorboard", default=False,
        help="Write timers to tensorboard.", read_by="megatron/training.py")
    log_batch_size_to_tensorboard: bool = setting("--log-batch-size-to-tensorboard", default=False,
        help="Write batch size to tensorboard.", read_by="megatron/logging_utils.py")
    log_learning_rate_to_tensorboard: bool = setting("--no-log-learnig-rate-to-tensorboard",
        "--no-log-learning-rate-to-tensorboard", default=True, help="Do not write the learning rate to tensorboard.",
        read_by="megatron/logging_utils.py")
    log_loss_scale_to_tensorboard: bool = setting("--no-log-loss-scale-to-tensorboard", default=True,
        help="Do not write the loss scale to tensorboard.", read_by="megatron/logging_utils.py")
    log_validation_ppl_to_tensorboard: bool = setting("--log-validation-ppl-to-tensorboard", default=False,
        help="Write validation perplexity to tensorboard.", read_by="megatron/logging_utils.py")
    log_memory_to_tensorboard: bool = setting("--log-memory-to-tensorboard", default=False,
        help="Write memory use to tensorboard.", read_by="megatron/logging_utils.py")
    log_world_size_to_tensorboard: bool = setting("--log-world-size-to-tensorboard", default=False,
        help="Write world size to tensorboard.", read_by="megatron/logging_utils.py")
    log_optimizer_states_to_tensorboard: bool = setting("--log-optimizer-states-to-tensorboard", default=False,
        help="Write optimizer state statistics to tensorboard.", refused="is not implemented")
    log_straggler: bool = setting("--log-straggler", default=False,
        help="Time every rank's training forward steps and report the slowest/fastest ranks every --log-interval "
             "(Megatron's straggler detector).", read_by="megatron/straggler.py")
    disable_straggler_on_startup: bool = setting("--disable-straggler-on-startup", default=False,
        help="Start the straggler detector off (toggle it through --straggler-ctrlr-port).",
        read_by="megatron/straggler.py")
    straggler_ctrlr_port: int = setting("--straggler-ctrlr-port", default=65535,
        help="Rank 0's port toggling the straggler detector (any connection, e.g. curl host:port).",
        read_by="megatron/straggler.py")
    straggler_minmax_count: int = setting("--straggler-minmax-count", default=1,
        help="Also print the N ranks with the lowest and highest estimated throughput.",
        read_by="megatron/straggler.py")
    straggler_threshold: float = setting("--straggler-threshold", default=2.0,
        help="Name a rank as a straggler when its time per iteration exceeds this multiple of the median of the "
             "other ranks (not in Megatron-LM: it prints the min/max ranks only).", read_by="megatron/straggler.py")


@dataclasses.dataclass
class InferenceSettings:
    """--help group "inference"."""

    TITLE: ClassVar[str] = "inference"
    inference_batch_times_seqlen_threshold: int = setting("--inference-batch-times-seqlen-threshold", default=512,
        help="Pipeline the forward pass during inference above this batch * seq-length.",
        variant="generation sends the whole batch through the pipeline stages at once; micro-batching it gives "
                "the same tokens")
    max_tokens_to_oom: int = setting("--max-tokens-to-oom", default=12000,
        help="Refuse generation above this many tokens.", read_by="tools/run_text_generation_server.py")
    # The inference engine (megatron/inference/, docs/inference.md): Megatron-LM's dynamic-batching flags.
    inference_dynamic_batching: bool = setting("--inference-dynamic-batching", default=False,
        help="Generate with the inference engine (continuous batching, paged KV cache) instead of static batches.",
        read_by=ENGINE)
    inference_dynamic_batching_buffer_size_gb: float = setting("--inference-dynamic-batching-buffer-size-gb",
        default=40.0, help="GiB of KV cache the engine allocates (in blocks; requests queue when it is full).",
        read_by=ENGINE)
    inference_dynamic_batching_paused_buffer_size_gb: Optional[float] = setting(
        "--inference-dynamic-batching-paused-buffer-size-gb", help="Memory for paused requests.",
        refused="does not apply: the engine reserves a request's blocks at admission and never pauses it")
    inference_dynamic_batching_block_size: int = setting("--inference-dynamic-batching-block-size", default=256,
        help="Tokens per KV-cache block.", read_by=ENGINE)
    inference_dynamic_batching_max_requests: Optional[int] = setting("--inference-dynamic-batching-max-requests",
        help="Most requests running at once (default: one per KV-cache block).", read_by=ENGINE)
    inference_dynamic_batching_max_tokens: Optional[int] = setting("--inference-dynamic-batching-max-tokens",
        help="Most tokens one engine step feeds (default 16384).", read_by=ENGINE)
    inference_dynamic_batching_num_cuda_graphs: int = setting("--inference-dynamic-batching-num-cuda-graphs",
        default=16, help="CUDA graphs to capture.", refused="is not implemented (the engine captures no CUDA graph)")
    inference_dynamic_batching_unified_memory_level: int = setting(
        "--inference-dynamic-batching-unified-memory-level", default=0, choices=[0, 1],
        help="Unified-memory level of the KV cache.", refused="is not implemented (the KV cache is device memory)")
    disable_chunked_prefill: bool = setting("--enable-chunked-prefill", default=True, action="store_false",
        also=(extra_flag("--disable-chunked-prefill", action="store_true", default=True,
                         help="Do not chunk prefills (default)."),),
        help="Split long prompts over engine steps so that running requests keep decoding.", read_by=ENGINE)
