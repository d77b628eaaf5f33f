"""Number of micro-batches per step: constant, or ramped up with the global batch size (`--rampup-batch-size`).

Megatron's calculators: the global batch is split into `micro_batch_size * data_parallel_size` slices; with a
ramp-up the global batch starts at `start` and grows by `increment` every `rampup_samples / num_increments`
consumed samples until it reaches `--global-batch-size`.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union


class NumMicroBatchesCalculator:
    """Base: `.get()` micro-batches per step, `.get_current_global_batch_size()`, `.update(consumed, check)`."""

    num_micro_batches: int
    current_global_batch_size: int

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        raise NotImplementedError


class ConstantNumMicroBatches(NumMicroBatchesCalculator):
    """global_batch_size / (micro_batch_size * data_parallel_size) micro-batches on every step."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> None:
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(
                f"--micro-batch-size ({micro_batch_size}) and data-parallel size ({data_parallel_size}) must be > 0"
            )
        per_step = micro_batch_size * data_parallel_size
        if global_batch_size <= 0 or global_batch_size % per_step != 0:
            raise ValueError(
                f"--global-batch-size ({global_batch_size}) must be a positive multiple of --micro-batch-size "
                f"({micro_batch_size}) times data-parallel size ({data_parallel_size}) = {per_step}"
            )
        self.num_micro_batches = global_batch_size // per_step
        self.current_global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        pass


class RampupBatchsizeNumMicroBatches(NumMicroBatchesCalculator):
    """Linear batch-size ramp-up in steps of `batch_size_increment` over `ramup_samples` consumed samples."""

    def __init__(
        self,
        start_batch_size: int,
        batch_size_increment: int,
        ramup_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
    ) -> None:
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        if self.micro_batch_times_data_parallel_size <= 0:
            raise ValueError(
                f"--micro-batch-size ({micro_batch_size}) and data-parallel size ({data_parallel_size}) must be > 0"
            )
        if start_batch_size <= 0:
            raise ValueError(f"--rampup-batch-size: start batch size ({start_batch_size}) must be > 0")
        if global_batch_size <= 0:
            raise ValueError(f"--global-batch-size ({global_batch_size}) must be > 0")
        if batch_size_increment <= 0:
            raise ValueError(f"--rampup-batch-size: batch size increment ({batch_size_increment}) must be > 0")
        if ramup_samples < 0:
            raise ValueError(f"--rampup-batch-size: ramp-up samples ({ramup_samples}) must be >= 0")
        diff_batch_size = global_batch_size - start_batch_size
        if diff_batch_size < 0:
            raise ValueError(
                f"--rampup-batch-size: start batch size ({start_batch_size}) must be <= --global-batch-size "
                f"({global_batch_size})"
            )
        if diff_batch_size % batch_size_increment != 0:
            raise ValueError(
                f"--rampup-batch-size: --global-batch-size ({global_batch_size}) minus start batch size "
                f"({start_batch_size}) = {diff_batch_size} must be divisible by the increment ({batch_size_increment})"
            )
        self.start_batch_size = start_batch_size
        self.batch_size_increment = batch_size_increment
        self.global_batch_size = global_batch_size
        self.ramup_samples = ramup_samples
        num_increments = diff_batch_size // batch_size_increment
        # With no increments the batch size is constant from the start.
        self.rampup_samples_per_increment = ramup_samples / num_increments if num_increments > 0 else float("inf")
        self.update(0, False)

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        if consumed_samples > self.ramup_samples or self.rampup_samples_per_increment == float("inf"):
            self.current_global_batch_size = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            self.current_global_batch_size = self.start_batch_size + steps * self.batch_size_increment
            self.current_global_batch_size = min(self.current_global_batch_size, self.global_batch_size)
        if consistency_check and self.current_global_batch_size % self.micro_batch_times_data_parallel_size != 0:
            raise ValueError(
                f"--rampup-batch-size: current global batch size ({self.current_global_batch_size}) at "
                f"{consumed_samples} consumed samples is not divisible by --micro-batch-size ({self.micro_batch_size})"
                f" times data-parallel size ({self.data_parallel_size}); pick a start and increment that are "
                f"multiples of {self.micro_batch_times_data_parallel_size}"
            )
        self.num_micro_batches = max(1, self.current_global_batch_size // self.micro_batch_times_data_parallel_size)


def build_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[Sequence[Union[int, str]]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> NumMicroBatchesCalculator:
    """Megatron's factory; prints the chosen schedule on rank 0."""
    if rampup_batch_size is None:
        calc: NumMicroBatchesCalculator = ConstantNumMicroBatches(
            global_batch_size, micro_batch_size, data_parallel_size
        )
        if rank == 0:
            print(f"setting number of micro-batches to constant {calc.get()}", flush=True)
        return calc
    if len(rampup_batch_size) != 3:
        raise ValueError(
            "--rampup-batch-size expects 3 values: <start batch size> <batch size increment> <ramp-up samples>, "
            f"got {list(rampup_batch_size)}"
        )
    try:
        start, increment, samples = (int(v) for v in rampup_batch_size)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--rampup-batch-size values must be integers, got {list(rampup_batch_size)}") from exc
    if rank == 0:
        print(
            f"will use batch size rampup starting from global batch size {start} to global batch size "
            f"{global_batch_size} with batch size increments {increment} over {samples} samples.",
            flush=True,
        )
    return RampupBatchsizeNumMicroBatches(start, increment, samples, global_batch_size, micro_batch_size,
                                          data_parallel_size)
