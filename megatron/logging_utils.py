"""Training/validation log lines and TensorBoard scalars in Megatron(-DeepSpeed)'s exact formats.

The per-interval line is the BigScience Megatron-DeepSpeed one::

     iteration       10/      20 | consumed samples:           80 | consumed tokens:         5120 |
     elapsed time per iteration (s): 0.12 | learning rate: 1.000E-04 | global batch size:     8 |
     lm loss: 8.012345E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |
     number of nan iterations:   0 | samples per second: 66.667 | TFLOPs: 0.01 |

(one line in the log). TensorBoard tags follow Megatron-LM: ``learning-rate``, ``batch-size``, ``lm loss``,
``loss-scale``, ``grad-norm``, ``num-zeros``, ``params-norm``, ``iteration-time``, each also ``… vs samples``, and
``lm loss validation`` / ``lm loss validation ppl`` (+ ``vs samples``) for evaluations.
"""
from __future__ import annotations

import math
import resource
import sys
from typing import Any, Optional

import torch

from megatron.core import parallel_state
from megatron.core.rank_print import is_last_rank, print_line, print_rank_0, print_rank_last  # noqa: F401  (re-exported)
from megatron.run_configs.log_settings import LogSettings

ADVANCED = "advanced iterations"
SKIPPED = "skipped iterations"
NAN = "nan iterations"








def accumulate_losses(
    loss_dict: dict[str, Any], total_loss_dict: dict[str, Any], skipped_iter: int
) -> None:
    """Megatron's bookkeeping: sum losses over advanced iterations, count skipped and nan iterations."""
    if not skipped_iter:
        total_loss_dict[ADVANCED] = total_loss_dict.get(ADVANCED, 0) + 1
    else:
        total_loss_dict.setdefault(ADVANCED, 0)
    total_loss_dict[SKIPPED] = total_loss_dict.get(SKIPPED, 0) + skipped_iter
    got_nan = False
    for key, value in loss_dict.items():
        value = float(value)
        if not skipped_iter:
            total_loss_dict[key] = total_loss_dict.get(key, 0.0) + value
        else:
            got_nan = got_nan or not math.isfinite(value)
    total_loss_dict[NAN] = total_loss_dict.get(NAN, 0) + int(got_nan)


def format_training_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    consumed_tokens: int,
    elapsed_per_iter: float,
    learning_rate: float,
    batch_size: int,
    losses: dict[str, float],
    loss_scale: Optional[float],
    grad_norm: Optional[float],
    num_zeros_in_grad: Optional[float],
    params_norm: Optional[float],
    skipped: int,
    nans: int,
    samples_per_sec: float,
    tflops: float,
    skipped_samples: int = 0,
) -> str:
    """The BigScience Megatron-DeepSpeed training log line (with Megatron-LM's skipped samples when there are)."""
    s = f" iteration {iteration:8d}/{train_iters:8d} |"
    s += f" consumed samples: {consumed_samples:12d} |"
    if skipped_samples > 0:
        s += f" skipped samples: {skipped_samples:12d} |"
    s += f" consumed tokens: {consumed_tokens:12d} |"
    s += f" elapsed time per iteration (s): {elapsed_per_iter:.2f} |"
    s += f" learning rate: {learning_rate:.3E} |"
    s += f" global batch size: {batch_size:5d} |"
    for key, avg in losses.items():
        if math.isnan(avg) or math.isinf(avg):  # a non-finite loss is shown, never hidden
            s += f" {key}: {'nan' if math.isnan(avg) else avg} |"
        elif avg > 0.0:
            s += f" {key}: {avg:.6E} |"
    if loss_scale is not None:
        s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    if num_zeros_in_grad is not None:
        s += f" num zeros: {num_zeros_in_grad:.1f} |"
    if params_norm is not None:
        s += f" params norm: {params_norm:.3f} |"
    s += f" number of skipped iterations: {skipped:3d} |"
    s += f" number of nan iterations: {nans:3d} |"
    s += f" samples per second: {samples_per_sec:.3f} |"
    s += f" TFLOPs: {tflops:.2f} |"
    return s


def write_train_scalars(
    writer: Any,
    show: LogSettings,
    iteration: int,
    loss_dict: dict[str, float],
    learning_rate: float,
    batch_size: int,
    loss_scale: float,
    grad_norm: Optional[float],
    num_zeros_in_grad: Optional[float],
    params_norm: Optional[float],
    consumed_samples: int,
) -> None:
    """Per-iteration TensorBoard scalars (every --tensorboard-log-interval), Megatron-LM tag names; the "vs samples"
    axis is `consumed_samples` (the run's consumed training samples)."""
    samples = int(consumed_samples)

    def both(tag: str, value: float) -> None:
        writer.add_scalar(tag, value, iteration)
        writer.add_scalar(f"{tag} vs samples", value, samples)

    if show.log_learning_rate_to_tensorboard:
        both("learning-rate", learning_rate)
    if show.log_batch_size_to_tensorboard:
        both("batch-size", batch_size)
    for key, value in loss_dict.items():
        both(key, float(value))
    if show.log_loss_scale_to_tensorboard:
        both("loss-scale", loss_scale)
    if show.log_world_size_to_tensorboard:
        both("world-size", show.world_size)
    if grad_norm is not None:
        both("grad-norm", grad_norm)
    if num_zeros_in_grad is not None:
        both("num-zeros", num_zeros_in_grad)
    if params_norm is not None:
        both("params-norm", params_norm)
    if show.log_memory_to_tensorboard and torch.cuda.is_available():
        both("mem-reserved-bytes", torch.cuda.memory_reserved())
        both("mem-allocated-bytes", torch.cuda.memory_allocated())


def format_validation_line(prefix: str, losses: dict[str, float]) -> tuple[str, dict[str, float]]:
    """Megatron's ``validation loss at {prefix} | lm loss value: … | lm loss PPL: … |`` and the PPL per key."""
    s = f" validation loss at {prefix} | "
    ppls = {}
    for key, value in losses.items():
        ppl = math.exp(min(20.0, value)) if math.isfinite(value) else float("nan")  # no made-up PPL for nan
        ppls[key] = ppl
        if math.isfinite(value):
            s += f"{key} value: {value:.6E} | "
            s += f"{key} PPL: {ppl:.6E} | "
        else:
            s += f"{key} value: {str(value).lower()} | {key} PPL: nan | "
    return s, ppls


def log_validation(
    prefix: str, losses: dict[str, float], writer: Any, show: LogSettings, iteration: int, consumed_samples: int,
) -> str:
    """Print the framed validation line on the last rank and write the validation scalars ("vs samples":
    `consumed_samples`, the run's consumed training samples)."""
    line, ppls = format_validation_line(prefix, losses)
    if writer is not None:
        samples = int(consumed_samples)
        for key, value in losses.items():
            writer.add_scalar(f"{key} validation", value, iteration)
            writer.add_scalar(f"{key} validation vs samples", value, samples)
            if show.log_validation_ppl_to_tensorboard:
                writer.add_scalar(f"{key} validation ppl", ppls[key], iteration)
                writer.add_scalar(f"{key} validation ppl vs samples", ppls[key], samples)
    length = len(line) + 1
    print_rank_last("-" * length)
    print_rank_last(line)
    print_rank_last("-" * length)
    return line


def _rss_now_bytes() -> Optional[int]:
    """This process's resident set size now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


def _rss_peak_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_stats_mb() -> dict[str, float]:
    """allocated / max allocated / reserved / max reserved in MB.

    On CUDA: torch.cuda's allocator statistics. On CPU there is no caching allocator to ask, so allocated and
    reserved are both the process's resident set size now (/proc/self/statm) and max allocated / max reserved
    both its peak resident set size (getrusage ru_maxrss): the whole process, weights, optimizer state and the
    Python runtime included.
    """
    mb = 1024.0 * 1024.0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"allocated": torch.cuda.memory_allocated() / mb, "max allocated": torch.cuda.max_memory_allocated() / mb,
                "reserved": torch.cuda.memory_reserved() / mb, "max reserved": torch.cuda.max_memory_reserved() / mb}
    now = _rss_now_bytes()
    peak = max(_rss_peak_bytes(), now or 0) / mb  # ru_maxrss is sampled by the kernel; never below "now"
    now_mb = peak if now is None else now / mb
    return {"allocated": now_mb, "max allocated": peak, "reserved": now_mb, "max reserved": peak}


def report_memory(name: str, data_parallel_rank: Optional[int] = None) -> Optional[str]:
    """Megatron's memory line, printed by every rank whose data-parallel rank is 0 (one line per model shard)::

        [Rank 0] (after 1 iterations) memory (MB) | allocated: … | max allocated: … | reserved: … | max reserved: …

    CUDA allocator statistics on GPU, process RSS / peak RSS on CPU (see `memory_stats_mb`). Returns the line
    (None on ranks that stay silent).
    """
    if data_parallel_rank is None:
        data_parallel_rank = parallel_state.current_parallel_state().dp_rank
    if data_parallel_rank != 0:
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    s = f"[Rank {rank}] {name} memory (MB)"
    for key, value in memory_stats_mb().items():
        s += f" | {key}: {value}"
    print_line(s)
    return s
