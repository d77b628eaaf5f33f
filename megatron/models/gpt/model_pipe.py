"""GPT as a DeepSpeed `PipelineModule` (Megatron-DeepSpeed's ``GPTModelPipe``) for ``--deepspeed`` with
``--pipeline-model-parallel-size > 1``, built from the same blocks as `GPTModel`.

Pipe layers (their index is the ``layer_XX`` of DeepSpeed's checkpoint files)::

    0          TiedLayerSpec("embed", EmbeddingPipe)      word (vocab-parallel) [+ --embed-layernorm's norm] +
                                                          position embeddings, dropout
    1 .. L     LayerSpec(ParallelTransformerLayerPipe)    transformer layer i-1 (global layer number i), built
                                                          from the same `gpt_layer_spec` as GPTModel's layers
    L + 1      LayerSpec(FinalLayerNormPipe)              the final norm (LayerNorm or RMSNorm, from the config)
    L + 2      TiedLayerSpec("embed", forward_fn=logits)  vocab-parallel logits through the tied word embedding
               (LayerSpec(OutputLayerPipe) with --untie-embeddings-and-output-weights)

and ``loss_fn`` = masked mean of the vocab-parallel cross entropy over (labels, loss_mask).

What crosses stages: only the hidden states [s, b, h]. With the standard causal mask (the default) the layers pass
``attention_mask=None`` and attention applies the causal mask itself (identical numerics: our attention recognises the
standard mask and uses the same causal kernel); the mask is neither sent between stages nor rebuilt. With
``--reset-attention-mask`` (per-document masks) the bool mask travels with the hidden states as ``(hidden, mask)``;
the engine must then be told (``engine.set_has_attention_mask(True)``, done by megatron.ds.pipe) because DeepSpeed
sends bool tensors as fp16 and receives no gradient for them.

Stage split: ``partition_method="type:transformer"`` gives every stage num_layers / pp transformer layers, the same
split as our non-DeepSpeed pipeline. The process topology is DeepSpeed's ``PipeModelDataParallelTopology`` whose
axes (pipe, data, model) put TP fastest, then DP, then PP: the layout of megatron.core.parallel_state.

The module also provides the layer-file <-> Megatron state-dict mapping used by the DeepSpeed checkpoint conversion
(megatron/checkpoint/conversion/deepspeed_format.py; `pipe_layer_specs_names`, `megatron_state_dict_from_pipe_layers`, `pipe_layers_from_megatron_state_dict`).
DeepSpeed is imported only when a `GPTModelPipe` is built (through megatron.optional); the mapping functions never
import it.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import torch

from megatron import optional
from megatron.core import tensor_parallel
from megatron.core.transformer_config import TransformerConfig
from megatron.errors import MegatronUserError
from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.layers.enums import AttnMaskType
from megatron.layers.language_model import Embedding, lm_cross_entropy, parallel_lm_logits
from megatron.layers.moe import router_losses
from megatron.layers.norms import build_norm
from megatron.layers.transformer import ParallelTransformerLayer
from megatron.models.gpt.layer_spec import gpt_layer_spec

EMBEDDING_PREFIX = "language_model.embedding."
LAYER_PREFIX = "language_model.encoder.layers.{}."
FINAL_LAYERNORM_PREFIX = "language_model.encoder.final_layernorm."
OUTPUT_LAYER_PREFIX = "language_model.output_layer."
TIED_KEY = "embed"
TIED_WEIGHT_ATTR = "word_embeddings.weight"

Hidden = Union[torch.Tensor, tuple]


class PipeConfigError(MegatronUserError):
    """A flag combination the DeepSpeed pipeline model does not support."""


def _split(inputs: Hidden) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(hidden, attention mask or None) from what a pipe layer receives."""
    if isinstance(inputs, (tuple, list)):
        return inputs[0], (inputs[1] if len(inputs) > 1 else None)
    return inputs, None


def _join(hidden: torch.Tensor, mask: Optional[torch.Tensor]) -> Hidden:
    return hidden if mask is None else (hidden, mask)


class EmbeddingPipe(Embedding):
    """Pipe layer 0: (tokens, position_ids[, attention_mask]) -> hidden [s, b, h] (or (hidden, mask))."""

    def forward(self, inputs: Any) -> Hidden:  # type: ignore[override]
        if not isinstance(inputs, (tuple, list)) or len(inputs) not in (2, 3):
            raise ValueError("EmbeddingPipe expects (tokens, position_ids[, attention_mask]) from the data iterator")
        tokens, position_ids = inputs[0], inputs[1]
        mask = inputs[2] if len(inputs) == 3 else None
        return _join(super().forward(tokens, position_ids), mask)


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """A transformer layer on the pipe: hidden (or (hidden, mask)) in, the same structure out.

    DeepSpeed's PipelineModule recomputes exactly the layers whose class name contains this name under activation
    checkpointing, so the name is part of the interface.
    """

    def forward(self, inputs: Hidden) -> Hidden:  # type: ignore[override]
        hidden, mask = _split(inputs)
        return _join(super().forward(hidden, mask), mask)


class FinalLayerNormPipe(torch.nn.Module):
    """The final norm (the config's LayerNorm | RMSNorm); drops the attention mask (the head does not need it).

    It owns the norm's parameters under the norm's own names (``weight`` [, ``bias``]), so the layer file holds
    what ``language_model.encoder.final_layernorm.*`` holds in a Megatron checkpoint.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        norm = build_norm(config)
        object.__setattr__(self, "_norm", norm)  # not a submodule: its parameters are registered on self
        self._parameters = norm._parameters  # one dict: dtype/device moves of self are seen by the norm

    def forward(self, inputs: Hidden) -> torch.Tensor:
        hidden, _ = _split(inputs)
        return self._norm(hidden)


class OutputLayerPipe(torch.nn.Module):
    """The untied output layer (--untie-embeddings-and-output-weights): hidden -> vocab-parallel logits."""

    def __init__(self, config: TransformerConfig, tp_group: Optional[Any] = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel
        self.weight = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, config.padded_vocab_size, config=config, init_method=config.init_method,
            tp_group=tp_group, bias=False).weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return parallel_lm_logits(hidden, self.weight, True, self.tp_group, sequence_parallel=self.sequence_parallel)


def _tied_logits(tp_group: Optional[Any], sequence_parallel: bool):
    """forward_fn of the tied head: logits [s, b, v/tp] from the embedding module's word-embedding weight."""

    def forward_fn(embedding: Embedding, hidden: Hidden) -> torch.Tensor:
        hidden, _ = _split(hidden)
        return parallel_lm_logits(hidden, embedding.word_embeddings.weight, True, tp_group,
                                  sequence_parallel=sequence_parallel)

    return forward_fn


class GPTLossPipe:
    """loss_fn of the pipe: masked mean of the vocab-parallel cross entropy (the same arithmetic as pretrain_gpt)."""

    def __init__(self, tp_group: Optional[Any] = None, fp16_lm_cross_entropy: bool = False) -> None:
        self.tp_group = tp_group
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.__name__ = "GPTLossPipe"

    def __call__(self, logits: torch.Tensor, labels_and_mask: Any) -> torch.Tensor:
        labels, loss_mask = labels_and_mask
        losses = lm_cross_entropy(logits, labels, self.tp_group, self.fp16_lm_cross_entropy).float()
        loss_mask = loss_mask.view(-1).float()
        return torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()


def _checkpoint_func(distribute_saved_activations: bool, tp_group: Optional[Any]):
    """DeepSpeed's activation_checkpoint_func signature (function, *args) over our recompute function.

    `tensor_parallel.checkpoint` is looked up at call time so that a DeepSpeed hook installed in the recompute path
    (--deepspeed-activation-checkpointing) applies here as in the rest of the model.
    """

    def checkpoint(function: Any, *args: Any) -> Any:
        return tensor_parallel.checkpoint(function, distribute_saved_activations, *args, tp_group=tp_group)

    return checkpoint


def pipe_topology(parallel_state: Any) -> Any:
    """DeepSpeed's PipeModelDataParallelTopology for our ParallelState (same rank layout: TP, then DP, then PP)."""
    topology = optional.deepspeed("runtime.pipe.topology")
    topo = topology.PipeModelDataParallelTopology(num_pp=parallel_state.pp_size, num_mp=parallel_state.tp_size,
                                         num_dp=parallel_state.dp_size)
    coord = topo.get_coord(parallel_state.global_rank)
    if (coord.pipe, coord.data, coord.model) != (parallel_state.pp_rank, parallel_state.dp_rank,
                                                 parallel_state.tp_rank):
        raise RuntimeError(
            f"DeepSpeed topology puts rank {parallel_state.global_rank} at (pp, dp, tp) = "
            f"{(coord.pipe, coord.data, coord.model)} but megatron.core.parallel_state at "
            f"{(parallel_state.pp_rank, parallel_state.dp_rank, parallel_state.tp_rank)}")
    return topo


def ensure_deepspeed_comm() -> None:
    """Initialise deepspeed.comm (PipelineModule and deepspeed.checkpointing.configure use it) over the already
    initialised torch.distributed group; no-op when done."""
    ds_comm = optional.deepspeed("comm")
    if "LOCAL_RANK" not in os.environ:  # PipelineModule reads it; launchers set it, plain SLURM may not
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if not ds_comm.is_initialized():
        if not torch.distributed.is_initialized():
            raise RuntimeError("GPTModelPipe needs torch.distributed initialised (initialize_megatron does it)")
        optional.deepspeed().init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)


def _layer_specs(config: TransformerConfig, tp_group: Optional[Any]) -> list:
    """The LayerSpec / TiedLayerSpec list of the whole model (see the module docstring for the indices)."""
    pipe = optional.deepspeed("pipe")
    LayerSpec, TiedLayerSpec = pipe.LayerSpec, pipe.TiedLayerSpec  # noqa: N806 - DeepSpeed's class names
    tied = config.share_embeddings_and_output_weights
    layer_spec = gpt_layer_spec(config)
    embed_args = (config.hidden_size, config.padded_vocab_size, config.max_position_embeddings,
                  config.hidden_dropout, config)
    specs: list = []
    if tied:
        specs.append(TiedLayerSpec(TIED_KEY, EmbeddingPipe, *embed_args, tp_group=tp_group,
                                   tied_weight_attr=TIED_WEIGHT_ATTR))
    else:
        specs.append(LayerSpec(EmbeddingPipe, *embed_args, tp_group=tp_group))
    for i in range(config.num_layers):
        specs.append(LayerSpec(ParallelTransformerLayerPipe, config, i + 1, tp_group,
                               self_attn_mask_type=AttnMaskType.causal, spec=layer_spec))
    specs.append(LayerSpec(FinalLayerNormPipe, config))
    if tied:
        specs.append(TiedLayerSpec(TIED_KEY, EmbeddingPipe, *embed_args, tp_group=tp_group, embed_layernorm=False,
                                   forward_fn=_tied_logits(tp_group, config.sequence_parallel),
                                   tied_weight_attr=TIED_WEIGHT_ATTR))
    else:
        specs.append(LayerSpec(OutputLayerPipe, config, tp_group))
    return specs


def _check_supported(config: TransformerConfig, parallel_state: Any, num_tokentypes: int) -> None:
    if config.sequence_parallel:
        raise PipeConfigError(
            "--sequence-parallel is not supported with the DeepSpeed pipeline engine (DeepSpeed does not all-reduce "
            "the sequence-parallel LayerNorm grads); drop --sequence-parallel or add --no-pipeline-parallel")
    if num_tokentypes:
        raise PipeConfigError("GPTModelPipe has no tokentype embeddings; GPT uses num_tokentypes=0")
    if config.mtp_num_layers:
        raise PipeConfigError("--mtp-num-layers is not supported with the DeepSpeed pipeline engine (GPTModelPipe has "
                              "no multi-token-prediction block); add --no-pipeline-parallel or use Megatron's pipeline")
    if config.num_layers % parallel_state.pp_size != 0:
        raise PipeConfigError(f"--num-layers ({config.num_layers}) must be divisible by "
                              f"--pipeline-model-parallel-size ({parallel_state.pp_size})")


def _make_gpt_model_pipe_class() -> type:
    class GPTModelPipe(optional.deepspeed("pipe").PipelineModule):
        """Megatron-DeepSpeed's GPTModelPipe: GPT as a PipelineModule; building it is collective over all ranks.

        `parallel_state` is our megatron.core.parallel_state.ParallelState (its groups are used by the layers;
        DeepSpeed builds its own groups of the same layout from the topology).
        """

        def __init__(
            self,
            config: TransformerConfig,
            parallel_state: Any,
            *,
            num_tokentypes: int = 0,
            fp16_lm_cross_entropy: bool = False,
            carry_attention_mask: bool = False,
            partition_method: str = "type:transformer",
        ) -> None:
            _check_supported(config, parallel_state, num_tokentypes)
            ensure_deepspeed_comm()
            tp_group = parallel_state.tp_group
            interval = int(config.recompute_num_layers or 1) if config.recompute_granularity == "full" else 0
            distribute = bool(config.distribute_saved_activations and not config.sequence_parallel)
            super().__init__(
                layers=_layer_specs(config, tp_group),
                topology=pipe_topology(parallel_state),
                loss_fn=GPTLossPipe(tp_group, fp16_lm_cross_entropy),
                partition_method=partition_method,
                activation_checkpoint_interval=interval,
                activation_checkpoint_func=_checkpoint_func(distribute, tp_group),
            )
            self.config = config
            self.parallel_state = parallel_state
            self.aux_losses = router_losses(config, tp_group)  # the named losses the loop logs (as GPTModel's)
            self.carry_attention_mask = carry_attention_mask
            self.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
            expected = config.num_layers // parallel_state.pp_size
            mine = sum(isinstance(f, ParallelTransformerLayerPipe) for f in self.forward_funcs)
            if mine != expected:
                raise RuntimeError(f"DeepSpeed put {mine} transformer layers on pipeline stage "
                                   f"{parallel_state.pp_rank}, expected {expected} (partition {self.parts})")

        def local_layer_modules(self) -> dict[int, torch.nn.Module]:
            """{pipe layer index: module holding its weights} for the layers built on this stage."""
            out: dict[int, torch.nn.Module] = {}
            for idx in range(self._local_start, self._local_stop):
                spec = self._layer_specs[idx]
                if hasattr(spec, "key"):  # TiedLayerSpec
                    if spec.forward_fn is None:
                        out[idx] = self.tied_modules[spec.key]
                elif str(idx) in self._modules:
                    out[idx] = self._modules[str(idx)]
            return out

        def load_megatron_state_dict(self, state_dict: Mapping[str, Any]) -> None:
            """Load this stage's part of a GPTModel state dict (flat or Megatron's nested checkpoint layout).

            The tied head's copy of the word embedding on the last stage takes the embedding's weight too.
            """
            layers = pipe_layers_from_megatron_state_dict(state_dict, self.config.num_layers)
            modules = self.local_layer_modules()
            for idx, module in modules.items():
                module.load_state_dict(layers[idx], strict=True)
            for key, module in self.tied_modules.items():
                if key == TIED_KEY and not any(m is module for m in modules.values()):
                    with torch.no_grad():
                        module.word_embeddings.weight.copy_(layers[0][TIED_WEIGHT_ATTR])

    GPTModelPipe.__module__ = __name__
    GPTModelPipe.__qualname__ = "GPTModelPipe"
    return GPTModelPipe


_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """``GPTModelPipe`` is created on first access, so importing this module does not import DeepSpeed."""
    if name == "GPTModelPipe":
        if name not in _CLASSES:
            _CLASSES[name] = _make_gpt_model_pipe_class()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_gpt_model_pipe(module: Any) -> bool:
    """True for a GPTModelPipe instance (without importing DeepSpeed when none was built)."""
    cls = _CLASSES.get("GPTModelPipe")
    return cls is not None and isinstance(module, cls)


# ------------------------------------------------------------------------------------------ checkpoint mapping
def pipe_layer_specs_names(num_layers: int, tied: bool = True) -> list[Optional[str]]:
    """The Megatron state-dict prefix of every pipe layer index (the XX of ``layer_XX-model_YY-model_states.pt``).

    0 -> "language_model.embedding.", i in 1..L -> "language_model.encoder.layers.{i-1}.",
    L+1 -> "language_model.encoder.final_layernorm.", L+2 -> None for the tied head (DeepSpeed writes no file for
    it: it shares layer 0's word embedding) or "language_model.output_layer." when untied.
    """
    names: list[Optional[str]] = [EMBEDDING_PREFIX]
    names += [LAYER_PREFIX.format(i) for i in range(num_layers)]
    names.append(FINAL_LAYERNORM_PREFIX)
    names.append(None if tied else OUTPUT_LAYER_PREFIX)
    return names


def megatron_state_dict_from_pipe_layers(layers: Mapping[int, Mapping[str, Any]], num_layers: int) -> dict:
    """Flat GPTModel.state_dict() from {pipe layer index: that layer file's state dict} (one TP rank).

    Layers without a file (the tied head) are ignored; an unknown index or a missing layer raises ValueError.
    """
    tied = (num_layers + 2) not in layers
    names = pipe_layer_specs_names(num_layers, tied=tied)
    out: dict = {}
    for idx, sd in sorted(layers.items()):
        if not 0 <= idx < len(names):
            raise ValueError(f"pipe layer index {idx} is outside a {num_layers}-layer GPTModelPipe "
                             f"(0..{len(names) - 1}); is --num-layers right?")
        prefix = names[idx]
        if prefix is None:
            continue
        for key, value in sd.items():
            out[prefix + key] = value
    missing = [i for i, name in enumerate(names) if name is not None and i not in layers]
    if missing:
        raise ValueError(f"pipe layer files missing for layer indices {missing} of a {num_layers}-layer model")
    return out


def pipe_layers_from_megatron_state_dict(state_dict: Mapping[str, Any], num_layers: int) -> dict[int, dict]:
    """{pipe layer index: layer state dict} from a GPTModel state dict (flat or nested; one TP rank).

    The inverse of `megatron_state_dict_from_pipe_layers`; every key must belong to some pipe layer.
    """
    flat = flatten_checkpoint_state_dict(state_dict)
    flat = {k: v for k, v in flat.items() if not k.endswith("._extra_state")}
    tied = not any(k.startswith(OUTPUT_LAYER_PREFIX) for k in flat)
    names = pipe_layer_specs_names(num_layers, tied=tied)
    layers: dict[int, dict] = {}
    used: set = set()
    for idx, prefix in enumerate(names):
        if prefix is None:
            continue
        layers[idx] = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
        used.update(k for k in flat if k.startswith(prefix))
        if not layers[idx]:
            raise ValueError(f"state dict has no '{prefix}*' entries for pipe layer {idx}; is --num-layers "
                             f"({num_layers}) right?")
    extra = sorted(set(flat) - used)
    if extra:
        raise ValueError(f"state dict entries that map to no pipe layer of a {num_layers}-layer GPTModelPipe: "
                         f"{extra[:5]}{' ...' if len(extra) > 5 else ''}")
    return layers
