"""Workers for the pipeline tests (module level so `run_distributed` can pickle them).

Megatron seeds every pipeline stage differently (seed + 100 * pp_rank), so a pipelined run does not start from the
serial run's weights. To compare loss curves, ``serial_init_provider`` wraps ``pretrain_gpt.model_provider``: every
rank also builds the full, unsplit model from the run's seed (same TP layout) and copies its stage's slice of the
weights into the stage model. The serial reference runs through the same wrapper, so both start identically.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from tests.training._workers import run_pretrain


def _copy_stage_weights(full: torch.nn.Module, stage: torch.nn.Module) -> None:
    """Copy the full model's parameters into a pipeline stage (layer numbers shifted by the stage offset)."""
    full_params = dict(full.named_parameters())
    emb = "language_model.embedding.word_embeddings.weight"
    with torch.no_grad():
        for name, param in stage.named_parameters():
            if name == "word_embeddings.weight":  # the last stage's copy of the tied embedding
                src = full_params[emb]
            elif ".layers." in name and not name.startswith("mtp."):  # the MTP block is named as in the full model
                head, rest = name.split(".layers.", 1)
                local, tail = rest.split(".", 1)
                offset = stage.language_model.encoder.layers[int(local)].layer_number - 1
                src = full_params[f"{head}.layers.{offset}.{tail}"]
            else:
                src = full_params[name]
            param.copy_(src)


def serial_gpt(args: Any, state: Any) -> torch.nn.Module:
    """The full, unsplit GPTModel built from the run's seed (this rank's TP layout), leaving every RNG untouched."""
    from megatron.arguments import core_transformer_config_from_args
    from megatron.core.tensor_parallel import get_rng_tracker
    from megatron.core.tensor_parallel.random import model_parallel_manual_seed
    from megatron.models.gpt.model import GPTModel

    config = dataclasses.replace(core_transformer_config_from_args(args), pipeline_model_parallel_size=1,
                                 context_parallel_size=1)  # CP splits no weights
    tracker_states = get_rng_tracker().get_states()
    with torch.random.fork_rng(devices=[]):
        model_parallel_manual_seed(args.seed, state.tp_rank)
        torch.manual_seed(args.seed)
        full = GPTModel(config, tp_group=state.tp_group, pp_state=None, parallel_output=True)
    get_rng_tracker().set_states(tracker_states)
    return full


def serial_init_provider(provider: Callable) -> Callable:
    """Wrap a GPT model_provider so that every layout starts from the serial model's initial weights."""

    def model_provider(pre_process: bool = True, post_process: bool = True) -> Any:
        from megatron import global_vars
        from megatron.core import parallel_state as ps

        args = global_vars.get_args()
        state = ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()
        full = serial_gpt(args, state)
        stage = provider(pre_process=pre_process, post_process=post_process)
        _copy_stage_weights(full, stage)
        return stage

    return model_provider


def run_pretrain_serial_init(rank: int, world_size: int, argv: list[str], sigterm_at_call: Optional[int] = None
                             ) -> dict:
    """run_pretrain with the serial-init model provider."""
    from tests.harness import entry_providers

    return run_pretrain(rank, world_size, argv, sigterm_at_call,
                        model_provider=serial_init_provider(entry_providers("pretrain_gpt").model_provider))
