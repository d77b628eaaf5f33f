"""The DeepSpeed training backend: DeepSpeed's engine (ZeRO, its pipeline engine) behind the TrainingBackend seam.

Under ``--pipeline-model-parallel-size > 1`` (without --no-pipeline-parallel) the engine is DeepSpeed's
PipelineEngine, and the module it runs is the model family's pipe model from `PIPE_MODELS` (GPT: `GPTModelPipe`, as
Megatron-DeepSpeed's pretrain_gpt.py builds it); a family without one keeps its entry script's model provider, which
refuses in one line. The steps, evaluation, checkpoints, loss scale and parameter norm are megatron/ds/engine.py's.
DeepSpeed itself is imported only when an engine is built.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from megatron import global_vars
from megatron.backend.base import StepResult, TrainingBackend
from megatron.core import parallel_state as ps
from megatron.ds import engine as ds_engine
from megatron.model_setup import build_param_scheduler, record_run_length
from megatron.models.gpt import model_pipe
from megatron.training_state import TrainingState

if TYPE_CHECKING:
    from megatron.run_configs.bundle import RunConfigs


def gpt_model_pipe(configs: RunConfigs, state: ps.ParallelState) -> torch.nn.Module:
    """GPTModelPipe for pretrain_gpt.py's flags (the GPT/Llama/BLOOM family's DeepSpeed pipeline model; its class is
    built, importing DeepSpeed, on first use)."""
    if state.global_rank == 0:
        print(" > building GPT model ...", flush=True)
    return model_pipe.GPTModelPipe(dataclasses.replace(configs.transformer), state,  # its own copy of the model's config
                        fp16_lm_cross_entropy=configs.deepspeed.fp16_lm_cross_entropy,
                        carry_attention_mask=configs.deepspeed.reset_attention_mask)


# model family (--model-family, default "gpt") -> its pipe model for DeepSpeed's pipeline engine
PIPE_MODELS: dict[str, Callable[[RunConfigs, ps.ParallelState], torch.nn.Module]] = {"gpt": gpt_model_pipe}


def uses_pipeline_engine(configs: RunConfigs) -> bool:
    """DeepSpeed's pipeline engine runs the model: --pipeline-model-parallel-size > 1, no --no-pipeline-parallel."""
    return configs.step.pipeline_model_parallel_size > 1 and not configs.deepspeed.no_pipeline_parallel


class DeepSpeedBackend(TrainingBackend):
    """--deepspeed (see the module docstring)."""

    name = "deepspeed"

    def setup(self, model_provider: Callable, model_type: Any, configs: RunConfigs,
              state: ps.ParallelState) -> tuple[list, Any, Any]:
        pipe = PIPE_MODELS.get(configs.deepspeed.model_family) if uses_pipeline_engine(configs) else None
        if pipe is not None:
            def model_provider(pre_process: bool = True, post_process: bool = True) -> torch.nn.Module:
                return pipe(configs, state)

        def scheduler(optimizer: Any) -> Any:
            record_run_length(configs.flags)  # Megatron's builder writes the run's length onto args here
            return build_param_scheduler(optimizer, configs.schedule)

        return ds_engine.setup_deepspeed_model_and_optimizer(
            model_provider, model_type, configs.deepspeed, configs.optimizer, state, scheduler)

    def load(self, model: list, optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
             train_state: TrainingState) -> int:
        timers = global_vars.get_timers()
        timers("load-checkpoint", log_level=0).start(barrier=True)
        iteration = ds_engine.load_deepspeed_checkpoint(model, optimizer, opt_param_scheduler, configs.checkpoint,
                                                        configs.architecture, train_state)
        timers("load-checkpoint").stop(barrier=True)
        timers.log(["load-checkpoint"])
        return iteration

    def train_step(self, forward_step_func: Callable, data_iterator: Optional[Iterator], model: list,
                   optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
                   state: ps.ParallelState) -> StepResult:
        return ds_engine.deepspeed_train_step(forward_step_func, data_iterator, model, optimizer,
                                              opt_param_scheduler, configs.deepspeed, configs.batch, state)

    def evaluate(self, forward_step_func: Callable, data_iterator: Optional[Iterator], model: list,
                 process_non_loss_data_func: Optional[Callable], configs: RunConfigs, state: ps.ParallelState,
                 verbose: bool, count_valid_samples: bool, counts: Any) -> tuple[dict, Any]:
        return ds_engine.deepspeed_evaluate(forward_step_func, data_iterator, model, configs.deepspeed, configs.batch,
                                            state, counts, verbose, count_valid_samples), None

    def save(self, iteration: int, model: list, optimizer: Any, opt_param_scheduler: Any, configs: RunConfigs,
             train_loss: Optional[float], train_state: TrainingState, sign: bool = True) -> None:
        ds_engine.save_deepspeed_checkpoint(iteration, model, optimizer, opt_param_scheduler, configs.checkpoint,
                                            configs.architecture, train_state.megatron_args(configs.flags),
                                            train_state, sign=sign)

    def loss_scale(self, model: list, optimizer: Any) -> float:
        return ds_engine.deepspeed_loss_scale(model)

    def params_norm(self, model: list, state: ps.ParallelState) -> float:
        return ds_engine.deepspeed_params_norm(model, state)
