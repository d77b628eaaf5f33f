"""Multi-token prediction (DeepSeek-V3's MTP, Megatron Core's MultiTokenPredictionBlock): D sequential modules after
the decoder on the last pipeline stage, the k-th predicting token i+k+1 at position i; their losses, averaged and
scaled by --mtp-loss-scaling-factor / D, are added to the LM loss.

A shared part (not a family's): any GPT model may use it with --mtp-num-layers, as in Megatron-LM, so GPTModel builds
it from the layers below it and no family folder is imported. The k-th module (``mtp.layers.<k-1>``, Megatron Core's
names) takes the previous depth's hidden states h (the decoder's final-normed output at depth 1) and the embeddings e
of the input tokens shifted left by k (the word embeddings the model shares; the last k positions get token 0):
``final_layernorm(transformer_layer(eh_proj([enorm(e), hnorm(h)])))``, where ``eh_proj`` is a column-parallel
2h -> h projection whose output is gathered over TP (then scattered over the sequence under SP) and
``transformer_layer`` is a layer of the decoder's spec numbered num_layers + k (dense or MoE as the decoder's last
layer: megatron/layers/layer_specs.py; a router there records into the MoE losses as Megatron-LM counts them). Each depth's logits come from the
model's output layer; labels and loss mask are rolled left once more per depth (zeros enter at the end).

Each depth's loss enters backward through megatron.core.aux_losses.AuxLossAutoScaler attached to the decoder's
hidden states (Megatron's MTPLossAutoScaler: same backward scale as the main loss) and is recorded as the named loss
``mtp_<k> loss`` (Megatron-LM's MTPLossLoggingHelper name: the masked mean per micro-batch, averaged over
data-parallel ranks and micro-batches), which the loop logs and writes to TensorBoard like every declared loss.
Evaluation and generation (model.eval(), or no labels) skip the block: the KV cache never sees it.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from megatron.core import aux_losses, tensor_parallel
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.attention import model_parallel_rng_fork
from megatron.layers.language_model import lm_cross_entropy, parallel_lm_logits
from megatron.layers.layer_specs import TransformerLayerSpec
from megatron.layers.module import MegatronModule
from megatron.layers.norms import build_norm
from megatron.layers.transformer import ParallelTransformerLayer

# input_ids [b, s], position_ids [b, s] -> embeddings [s(/tp), b, h] (dropout, sequence-parallel scatter included)
EmbeddingFn = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def mtp_loss_name(depth: int) -> str:
    """The log line's / TensorBoard's name of depth `depth`'s loss (1-based), Megatron-LM's."""
    return f"mtp_{depth} loss"


def mtp_losses(config: TransformerConfig) -> Tuple[aux_losses.AuxLoss, ...]:
    """The named losses of the MTP block (every stage declares them, so the pipeline reductions match): one per
    depth, averaged over data-parallel ranks (Megatron-LM averages over the data-parallel group)."""
    if not config.mtp_num_layers:
        return ()
    return tuple(aux_losses.AuxLoss(mtp_loss_name(k + 1), 1, 1, dp_average=True)
                 for k in range(config.mtp_num_layers))


def roll_left(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tensor rolled left by one along the last dim with a zero entering at the end, its sum): Megatron Core's
    roll_tensor without context parallelism."""
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    rolled[..., -1] = 0
    return rolled, rolled.sum()


class MultiTokenPredictionLayer(MegatronModule):
    """One MTP depth: enorm, hnorm, eh_proj, a transformer layer of the decoder's spec, final_layernorm."""

    def __init__(self, config: TransformerConfig, depth: int, tp_group: Optional[Any],
                 spec: TransformerLayerSpec) -> None:
        super().__init__(config=config)
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel
        self.enorm = build_norm(config)
        self.hnorm = build_norm(config)
        self.eh_proj = tensor_parallel.ColumnParallelLinear(
            2 * config.hidden_size, config.hidden_size, config=config, init_method=config.init_method,
            tp_group=tp_group, bias=False, gather_output=False)
        self.transformer_layer = ParallelTransformerLayer(config, config.num_layers + depth, tp_group, spec=spec)
        self.final_layernorm = build_norm(config)

    def _project_and_layer(self, hidden_states: torch.Tensor, embeddings: torch.Tensor,
                           attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        combined = torch.cat((self.enorm(embeddings), self.hnorm(hidden_states)), -1)
        projected, _ = self.eh_proj(combined)
        projected = tensor_parallel.gather_from_tensor_model_parallel_region(projected, self.tp_group)
        if self.sequence_parallel:
            projected = tensor_parallel.scatter_to_sequence_parallel_region(projected, self.tp_group)
        return self.transformer_layer(projected, attention_mask)

    def forward(self, hidden_states: torch.Tensor, embeddings: torch.Tensor,
                attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Previous depth's hidden states and the shifted tokens' embeddings [s(/tp), b, h] -> this depth's."""
        config = self.config
        dropout = self.training and (config.hidden_dropout > 0 or config.attention_dropout > 0)
        with model_parallel_rng_fork(self.sequence_parallel and dropout):
            if config.recompute_granularity == "full" and config.recompute_method == "uniform" and self.training \
                    and torch.is_grad_enabled():
                out = tensor_parallel.checkpoint(self._project_and_layer, config.distribute_saved_activations
                                                 and not self.sequence_parallel, hidden_states, embeddings,
                                                 attention_mask, tp_group=self.tp_group)
            else:  # Megatron-LM recomputes no MTP layer with --recompute-method block
                out = self._project_and_layer(hidden_states, embeddings, attention_mask)
        return self.final_layernorm(out)


class MultiTokenPredictionBlock(MegatronModule):
    """The D MTP depths (``layers``) on the last pipeline stage; on other stages no layers, only the declarations of
    the named losses (``aux_losses``)."""

    def __init__(self, config: TransformerConfig, tp_group: Optional[Any], spec: TransformerLayerSpec,
                 build_layers: bool = True) -> None:
        super().__init__(config=config)
        if config.recompute_granularity == "full" and config.recompute_method == "uniform" and \
                (config.recompute_num_layers or 1) != 1:
            raise ValueError("--mtp-num-layers with --recompute-method uniform needs --recompute-num-layers 1 "
                             f"(got {config.recompute_num_layers}), as in Megatron-LM")
        self.aux_losses = mtp_losses(config)
        self.tp_group = tp_group
        self.layers = torch.nn.ModuleList(
            [MultiTokenPredictionLayer(config, k + 1, tp_group, spec) for k in range(config.mtp_num_layers)]
            if build_layers else [])

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor], hidden_states: torch.Tensor,
                attention_mask: Optional[torch.Tensor], embedding: EmbeddingFn) -> List[torch.Tensor]:
        """Hidden states of depths 1..D [s(/tp), b, h] from the decoder's output and the input tokens."""
        outputs = []
        for layer in self.layers:
            input_ids, _ = roll_left(input_ids)
            if position_ids is not None:
                position_ids, _ = roll_left(position_ids)
            hidden_states = layer(hidden_states, embedding(input_ids, position_ids), attention_mask)
            outputs.append(hidden_states)
        return outputs

    def attach_losses(self, hidden_states: torch.Tensor, depth_states: List[torch.Tensor], labels: torch.Tensor,
                      loss_mask: Optional[torch.Tensor], logits: Callable[[torch.Tensor], torch.Tensor],
                      fp16_lm_cross_entropy: bool = False) -> torch.Tensor:
        """The decoder's hidden states with each depth's loss attached for backward (scaled by
        --mtp-loss-scaling-factor / D) and recorded as ``mtp_<k> loss``; `logits` maps hidden states to
        vocab-parallel logits [s, b, v/tp]."""
        config = self.config
        scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
        mask = torch.ones_like(labels) if loss_mask is None else loss_mask
        for k, states in enumerate(depth_states):
            labels, _ = roll_left(labels)
            mask, num_tokens = roll_left(mask)
            loss = mask * lm_cross_entropy(logits(states), labels, self.tp_group, fp16_lm_cross_entropy)
            aux_losses.record(mtp_loss_name(k + 1), loss.sum() / num_tokens, 1, 1)
            hidden_states = aux_losses.AuxLossAutoScaler.apply(hidden_states, scale * loss / num_tokens)
        return hidden_states


def output_logits(weight: torch.Tensor, tp_group: Optional[Any], sequence_parallel: bool) -> Callable:
    """Hidden states -> vocab-parallel logits through the model's output weight (for `attach_losses`)."""
    return lambda states: parallel_lm_logits(states, weight, True, tp_group, sequence_parallel=sequence_parallel)


def embed_with_copy(word_embeddings: torch.nn.Module, config: TransformerConfig, tp_group: Optional[Any],
                    training: bool) -> EmbeddingFn:
    """The MTP embedding on a last pipeline stage without the input embedding: its copy of the word embeddings
    (kept equal to the first stage's, as for the tied output layer), then what the input embedding does next
    (transpose to [s, b, h], fp32 residual, sequence-parallel scatter, dropout). MTP needs rope or no position
    embedding, so there is no position table to add."""
    dropout = torch.nn.Dropout(config.hidden_dropout)
    dropout.train(training)

    def embed(input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        words = word_embeddings(input_ids)
        words = (words[0] if isinstance(words, tuple) else words).transpose(0, 1).contiguous()
        if config.fp32_residual_connection:
            words = words.float()
        if config.sequence_parallel:
            words = tensor_parallel.scatter_to_sequence_parallel_region(words, tp_group)
            with model_parallel_rng_fork(training and config.hidden_dropout > 0):
                return dropout(words)
        return dropout(words)

    return embed
