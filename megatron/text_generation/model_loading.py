"""Build a GPTModel for inference with the training helpers and load its weights (no optimizer, no RNG state)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

import torch

from megatron.arguments import core_transformer_config_from_args
from megatron.checkpoint.checkpointing import load_checkpoint
from megatron.core import parallel_state as ps
from megatron.errors import MegatronUserError
from megatron.model import GPTModel, ModelType
from megatron.run_configs.checkpoint import CheckpointSettings


class InferenceLoadError(MegatronUserError, ValueError):
    """Inference cannot start with these flags."""


def _state(state: Optional[ps.ParallelState]) -> ps.ParallelState:
    return ps.current_parallel_state(state)


def require_checkpoint(load_dir: str) -> None:
    """One-line InferenceLoadError when --load holds no Megatron checkpoint (inference never runs on random weights).
    """
    import os

    from megatron.checkpoint.checkpointing import TRACKER_FILENAME

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


def load_model_for_inference(args: argparse.Namespace, state: Optional[ps.ParallelState] = None,
                             parallel_output: bool = False) -> torch.nn.Module:
    """GPTModel for this rank (eval mode), weights from `args.load` when set; returns the (Float16-wrapped) module.

    `args` are initialised Megatron args (initialize_megatron). parallel_output=False gives full-vocab logits on
    every TP rank (what generation and evaluation want). Under pipeline parallelism this is the rank's stage
    (one chunk; virtual stages are refused).
    """
    from megatron.model_setup import get_model

    state = _state(state)
    if getattr(args, "num_layers_per_virtual_pipeline_stage", None) or (state.virtual_pp_size or 1) > 1:
        raise InferenceLoadError("inference does not support virtual pipeline stages; drop "
                                 "--num-layers-per-virtual-pipeline-stage (plain --pipeline-model-parallel-size works)")
    config = core_transformer_config_from_args(args)

    def provider(pre_process: bool = True, post_process: bool = True) -> GPTModel:
        return GPTModel(config, tp_group=state.tp_group, pp_state=state, parallel_output=parallel_output,
                        pre_process=pre_process, post_process=post_process)

    ckpt = CheckpointSettings.from_args(args)
    if ckpt.load:
        require_checkpoint(ckpt.load)  # before building the model: a wrong --load must not serve random weights
    model = get_model(provider, ModelType.encoder_or_decoder, args, state, wrap_with_ddp=False)[0]
    if ckpt.load:  # weights only
        load_checkpoint([model], None, None, args,
                        settings=dataclasses.replace(ckpt, no_load_optim=True, no_load_rng=True))
    model.eval()
    return model
