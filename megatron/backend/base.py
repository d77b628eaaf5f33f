"""The TrainingBackend interface (megatron/backend/__init__.py says how the backends fit together)."""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from megatron.core import parallel_state as ps
from megatron.training_state import TrainingState

if TYPE_CHECKING:
    from megatron.run_configs.bundle import RunConfigs

StepResult = tuple[dict, int, Optional[float], Optional[int]]  # (losses, skipped 0/1, grad norm, zeros in grads)


class TrainingBackend(abc.ABC):
    """How a model is built, stepped, evaluated, saved and loaded. `model` is the list of model chunks (Megatron) or
    ``[engine]`` (DeepSpeed), as `setup` returns it."""

    name: str = ""

    @abc.abstractmethod
    def setup(self, model_provider: Callable, model_type: Any, configs: RunConfigs,
              state: ps.ParallelState) -> tuple[list, Any, Any]:
        """(model chunks, optimizer, OptimizerParamScheduler), before any checkpoint is loaded."""

    @abc.abstractmethod
    def load(self, model: list, optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
             train_state: TrainingState) -> int:
        """Load --load (timed as ``load-checkpoint``); returns the iteration to continue from and fills
        `train_state`'s counters."""

    @abc.abstractmethod
    def train_step(self, forward_step_func: Callable, data_iterator: Optional[Iterator], model: list,
                   optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
                   state: ps.ParallelState) -> StepResult:
        """One iteration: forward/backward over the micro-batches, reductions, optimizer and LR step."""

    @abc.abstractmethod
    def evaluate(self, forward_step_func: Callable, data_iterator: Optional[Iterator], model: list,
                 process_non_loss_data_func: Optional[Callable], configs: RunConfigs, state: ps.ParallelState,
                 verbose: bool, count_valid_samples: bool, counts: Any) -> tuple[dict, Any]:
        """(mean losses over --eval-iters batches, collected non-loss data or None); validation samples are counted
        in `counts` (a TrainingState, or the flags)."""

    @abc.abstractmethod
    def save(self, iteration: int, model: list, optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
             train_loss: Optional[float], train_state: TrainingState, sign: bool = True) -> None:
        """Write the checkpoint of `iteration` to --save (collective); `sign=False`: without its manifest.json."""

    @abc.abstractmethod
    def loss_scale(self, model: list, optimizer: Any) -> float:
        """The current loss scale (1.0 without fp16 loss scaling)."""

    @abc.abstractmethod
    def params_norm(self, model: list, state: ps.ParallelState) -> float:
        """The L2 norm of all parameters (over the model-parallel ranks)."""
