"""Build a GPTModel for inference with the training helpers and load its weights (no optimizer, no RNG state)."""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Mapping, Optional

import torch

from megatron.arguments import core_transformer_config_from_args
from megatron.checkpoint.loading import read_checkpoint
from megatron.checkpoint.paths import TRACKER_FILENAME
from megatron.core import parallel_state as ps
from megatron.core.rank_print import print_rank_0
from megatron.errors import MegatronUserError
from megatron.layers import ModelType
from megatron.model_setup import build_model
from megatron.models.gpt.model import GPTModel
from megatron.run_configs.architecture import architecture_from_args
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.run_configs.declared import flag_value, with_settings
from megatron.run_configs.model_wrap import ModelWrapSettings
from megatron.training_state import TrainingState


class InferenceLoadError(MegatronUserError, ValueError):
    """Inference cannot start with these flags."""


def _state(state: Optional[ps.ParallelState]) -> ps.ParallelState:
    return ps.current_parallel_state(state)


def require_checkpoint(load_dir: str) -> None:
    """One-line InferenceLoadError when --load holds no Megatron checkpoint (inference never runs on random weights).
    """
    if not os.path.isdir(load_dir):
        raise InferenceLoadError(f"--load {load_dir}: no such directory; point --load at a folder written by --save "
                                 "(inference will not run with random weights)")
    if os.path.isfile(os.path.join(load_dir, TRACKER_FILENAME)):
        return
    if os.path.isfile(os.path.join(load_dir, "latest")):
        raise InferenceLoadError(f"--load {load_dir} holds a DeepSpeed checkpoint; convert it first: python "
                                 f"tools/convert_deepspeed_checkpoint.py --input-folder {load_dir} --output-folder "
                                 f"{load_dir.rstrip('/')}_megatron, then --load {load_dir.rstrip('/')}_megatron")
    raise InferenceLoadError(f"--load {load_dir} holds no checkpoint (no {TRACKER_FILENAME}); point --load at a "
                             "folder written by --save (inference will not run with random weights)")


def refuse_random_weights(load: Optional[str], allow_random_weights: bool, what: str) -> None:
    """No --load: one-line InferenceLoadError unless --allow-random-weights (the server's opt-in); with the opt-in,
    a warning. `what` names the run ("generation", "evaluation")."""
    if load:
        return
    if not allow_random_weights:
        raise InferenceLoadError(f"no --load: {what} would run on random weights; pass --load CHECKPOINT_DIR (a "
                                 "folder written by --save), or --allow-random-weights to use an untrained model")
    print_rank_0(f"WARNING: no --load given (--allow-random-weights): {what} runs on randomly initialised weights")


def _refuse_virtual_stages(virtual_stages: Optional[int], state: ps.ParallelState) -> None:
    if virtual_stages or (state.virtual_pp_size or 1) > 1:
        raise InferenceLoadError("inference does not support virtual pipeline stages; drop "
                                 "--num-layers-per-virtual-pipeline-stage (plain --pipeline-model-parallel-size works)")


def build_inference_model(config: Any, checkpoint: CheckpointSettings, wrap: ModelWrapSettings,
                          architecture: Mapping[str, Any], state: Optional[ps.ParallelState] = None,
                          parallel_output: bool = False, kernels: Any = None,
                          on_restored: Optional[Callable[[TrainingState, tuple], None]] = None) -> torch.nn.Module:
    """GPTModel for this rank (eval mode) from the model's TransformerConfig `config`, weights from
    ``checkpoint.load`` when set (model only: no optimizer, no RNG state); returns the (Float16-wrapped) module.

    `wrap`: how the chunk is built and cast; `architecture`: this run's architecture record (checked against the
    checkpoint's); `kernels`: what the fused-kernels start-up line describes (default: `config`); `on_restored`:
    called with the checkpoint's consumed samples (see `read_checkpoint`). parallel_output=False gives full-vocab
    logits on every TP rank (what generation and evaluation want). Under pipeline parallelism this is the rank's
    stage (one chunk; virtual stages are refused).
    """
    state = _state(state)
    _refuse_virtual_stages(wrap.virtual_pipeline_model_parallel_size, state)

    def provider(pre_process: bool = True, post_process: bool = True) -> GPTModel:
        return GPTModel(config, tp_group=state.tp_group, pp_state=state, parallel_output=parallel_output,
                        pre_process=pre_process, post_process=post_process)

    if checkpoint.load:
        require_checkpoint(checkpoint.load)  # before building the model: a wrong --load must not serve random weights
    model = build_model(provider, ModelType.encoder_or_decoder, wrap, state, config if kernels is None else kernels,
                        wrap_with_ddp=False)[0]
    if checkpoint.load:  # weights only
        read_checkpoint([model], None, None, with_settings(checkpoint, no_load_optim=True, no_load_rng=True),
                        architecture, TrainingState(), on_restored=on_restored)
    model.eval()
    return model


def load_model_for_inference(args: argparse.Namespace, state: Optional[ps.ParallelState] = None,
                             parallel_output: bool = False) -> torch.nn.Module:
    """`build_inference_model` with the records built from initialised Megatron args (initialize_megatron), for
    the entry scripts. Like Megatron's ``get_model``/``load_checkpoint`` it records ``model_type`` on ``args`` and
    the checkpoint's consumed samples (Megatron's names); the fused-kernels line describes the flags."""
    state = _state(state)
    _refuse_virtual_stages(flag_value(args, "num_layers_per_virtual_pipeline_stage"), state)
    config = core_transformer_config_from_args(args)
    checkpoint = CheckpointSettings.from_args(args)
    args.model_type = ModelType.encoder_or_decoder  # get_model records it, as Megatron's does
    wrap = ModelWrapSettings.from_args(args)
    return build_inference_model(config, checkpoint, wrap, architecture_from_args(args), state, parallel_output,
                                 kernels=args, on_restored=lambda restored, names: restored.write_counters(args, names))
