"""Workers for the DeepSpeed pipeline tests (module level so `run_distributed` can pickle them).

`run_pretrain_ds_serial_init` runs pretrain_gpt under DeepSpeed with a pipe model builder (the DeepSpeed backend's
PIPE_MODELS["gpt"], wrapped) that loads the weights of the serially initialised GPTModel (the same one tests/pipeline/_workers.serial_init_provider builds for the
non-DeepSpeed runs) into the GPTModelPipe stages via `GPTModelPipe.load_megatron_state_dict`, so DeepSpeed's
pipeline starts from exactly the serial run's weights.

`pipe_forward_worker` builds a one-stage GPTModelPipe and a GPTModel with the same weights and returns both losses.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from tests.ds._workers import ds_env, run_pretrain_ds
from tests.pipeline._workers import serial_gpt


def serial_init_pipe_provider(provider: Callable) -> Callable:
    """Wrap the DeepSpeed backend's GPT pipe model builder (megatron.backend.deepspeed.PIPE_MODELS["gpt"]): the
    GPTModelPipe it returns gets the serial model's initial weights."""

    def model_provider(configs: Any, state: Any) -> Any:
        from megatron.models.gpt.model_pipe import is_gpt_model_pipe

        full = serial_gpt(configs.flags, state)
        model = provider(configs, state)
        if not is_gpt_model_pipe(model):
            raise AssertionError("expected the DeepSpeed backend to build a GPTModelPipe")
        model.load_megatron_state_dict(full.state_dict())
        return model

    return model_provider


@contextlib.contextmanager
def serial_init_pipe_models() -> Iterator[None]:
    """While active, the DeepSpeed backend's GPT pipe model starts from the serial model's weights."""
    from megatron.backend import deepspeed as ds_backend

    base = ds_backend.PIPE_MODELS["gpt"]
    ds_backend.PIPE_MODELS["gpt"] = serial_init_pipe_provider(base)
    try:
        yield
    finally:
        ds_backend.PIPE_MODELS["gpt"] = base


def run_pretrain_ds_serial_init(rank: int, world_size: int, argv: list[str]) -> dict:
    """tests.ds._workers.run_pretrain_ds with the serial-init GPTModelPipe."""
    with serial_init_pipe_models():
        return run_pretrain_ds(rank, world_size, argv)


def pipe_forward_worker(rank: int, world_size: int) -> dict:
    """Loss of a one-stage GPTModelPipe vs GPTModel with the same weights on one batch, plus the state-dict round trip."""
    ds_env(rank, world_size)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.core.transformer_config import TransformerConfig
    from megatron.models.gpt.model import GPTModel
    from megatron.models.gpt.model_pipe import (
        GPTModelPipe,
        megatron_state_dict_from_pipe_layers,
        pipe_layer_specs_names,
        pipe_layers_from_megatron_state_dict,
    )

    state = ps.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, padded_vocab_size=128,
                               max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    model_parallel_manual_seed(1234, 0)
    gpt = GPTModel(config, tp_group=state.tp_group, pp_state=state)
    pipe = GPTModelPipe(config, state)
    sd = gpt.state_dict()
    pipe.load_megatron_state_dict(sd)

    g = torch.Generator().manual_seed(7)
    text = torch.randint(0, 128, (2, 17), generator=g)
    tokens, labels = text[:, :-1], text[:, 1:]
    position_ids = torch.arange(16).unsqueeze(0).expand(2, 16)
    loss_mask = torch.ones(2, 16)
    loss_mask[0, 3] = 0.0
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
    per_token = gpt(tokens, position_ids, mask, labels=labels)
    ref = (per_token.view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
    got = pipe.loss_fn(pipe((tokens, position_ids)), (labels, loss_mask))
    with_mask = pipe.loss_fn(pipe((tokens, position_ids, mask)), (labels, loss_mask))

    layers = {idx: {k: v.clone() for k, v in m.state_dict().items()}
              for idx, m in pipe.local_layer_modules().items()}
    back = megatron_state_dict_from_pipe_layers(layers, config.num_layers)
    again = pipe_layers_from_megatron_state_dict(sd, config.num_layers)
    ps.destroy_model_parallel()
    return {
        "ref": float(ref), "pipe": float(got), "pipe_with_mask": float(with_mask),
        "round_trip_keys_equal": sorted(back) == sorted(sd),
        "round_trip_values_equal": all(torch.equal(back[k], sd[k]) for k in sd),
        "layers_equal": sorted(again) == sorted(layers) and all(
            sorted(again[i]) == sorted(layers[i]) and all(torch.equal(again[i][k], layers[i][k]) for k in layers[i])
            for i in layers),
        "names": pipe_layer_specs_names(config.num_layers),
        "class_name": type(pipe).__name__,
    }
