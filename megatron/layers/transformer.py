"""Megatron's transformer: ParallelTransformerLayer (built from a layer spec, megatron/layers/layer_specs.py) and
the layer stack. Attention is in attention.py, the MLP in mlp.py, norms in norms.py.

Activations use Megatron's [sequence, batch, hidden] layout. Tensor parallelism comes from
megatron.core.tensor_parallel layers (heads and the MLP inner dimension are split across `tp_group`);
with `config.sequence_parallel` the residual stream is split along the sequence dimension.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.attention import (  # noqa: F401  (re-exported: Megatron's names live in transformer.py)
    MODEL_PARALLEL_RNG,
    CoreAttention,
    ParallelAttention,
    model_parallel_rng_fork,
)
from megatron.layers.enums import AttnMaskType, LayerType
from megatron.layers.inference_params import InferenceParams
from megatron.layers.layer_specs import TransformerLayerSpec, transformer_layer_spec
from megatron.layers.mlp import ParallelMLP  # noqa: F401  (re-exported: Megatron's name lives in transformer.py)
from megatron.layers.module import MegatronModule
from megatron.layers.moe import router_losses
from megatron.layers.norms import build_norm
from megatron.layers.utils import group_size, pp_size_of


def bias_dropout_add(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, prob: float, training: bool
) -> torch.Tensor:
    """residual + dropout(x + bias), Megatron's bias-dropout-add."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


class ParallelTransformerLayer(MegatronModule):
    """Pre-LN transformer layer: x + Attn(LN(x)), then + MLP(LN(.)); decoder layers add cross-attention.

    The parts come from `spec` (default: Megatron's layer for `layer_type` / `self_attn_mask_type`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        tp_group: Optional[Any] = None,
        layer_type: LayerType = LayerType.encoder,
        self_attn_mask_type: AttnMaskType = AttnMaskType.padding,
        spec: Optional[TransformerLayerSpec] = None,
    ) -> None:
        super().__init__(config=config)
        if spec is None:
            spec = transformer_layer_spec(self_attn_mask_type, cross_attention=layer_type == LayerType.decoder)
        self.layer_number = layer_number
        self.layer_type = LayerType.decoder if spec.cross_attention is not None else layer_type
        self.apply_residual_connection_post_layernorm = config.apply_residual_connection_post_layernorm
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = spec.input_norm(config, layer_number, tp_group)
        self.self_attention = spec.self_attention(config, layer_number, tp_group)
        if spec.cross_attention is not None:
            self.post_attention_layernorm = spec.pre_cross_attention_norm(config, layer_number, tp_group)
            self.inter_attention = spec.cross_attention(config, layer_number, tp_group)
            self.post_inter_attention_layernorm = spec.pre_mlp_norm(config, layer_number, tp_group)
        else:
            self.post_attention_layernorm = spec.pre_mlp_norm(config, layer_number, tp_group)
        self.mlp = spec.mlp(config, layer_number, tp_group)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        encoder_output: Optional[torch.Tensor] = None,
        enc_dec_attn_mask: Optional[torch.Tensor] = None,
        inference_params: Optional[InferenceParams] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        post_ln_residual = self.apply_residual_connection_post_layernorm
        ln_out = self.input_layernorm(hidden_states)
        packed = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
        attn_out, attn_bias = self.self_attention(ln_out, attention_mask, inference_params=inference_params, **packed)
        residual = ln_out if post_ln_residual else hidden_states
        ln_input = bias_dropout_add(attn_out, attn_bias, residual, self.hidden_dropout, self.training)
        ln_out = self.post_attention_layernorm(ln_input)

        if self.layer_type == LayerType.decoder:
            attn_out, attn_bias = self.inter_attention(ln_out, enc_dec_attn_mask, encoder_output=encoder_output)
            residual = ln_out if post_ln_residual else ln_input
            ln_input = bias_dropout_add(attn_out, attn_bias, residual, self.hidden_dropout, self.training)
            ln_out = self.post_inter_attention_layernorm(ln_input)

        mlp_out, mlp_bias = self.mlp(ln_out)
        residual = ln_out if post_ln_residual else ln_input
        return bias_dropout_add(mlp_out, mlp_bias, residual, self.hidden_dropout, self.training)


def layers_on_this_stage(config: TransformerConfig, pp_state: Optional[Any],
                         split_stack: Optional[str] = None) -> tuple[int, int]:
    """(number of layers in this model chunk, global index of its first layer) for the pipeline layout.

    ``split_stack`` ("encoder" / "decoder") places one stack of an encoder-and-decoder model under Megatron's
    --pipeline-model-parallel-split-rank R: the encoder's layers spread evenly over stages 0..R-1, the decoder's
    over R..P-1 (layer numbers restart at 1 in each stack).
    """
    pp_size = pp_size_of(pp_state)
    pp_rank = getattr(pp_state, "pp_rank", 0) if pp_state is not None else 0
    if split_stack is not None and pp_size > 1:
        split = getattr(pp_state, "pipeline_split_rank", None)
        if split is None:
            raise ValueError("an encoder-and-decoder model needs --pipeline-model-parallel-split-rank with "
                             "--pipeline-model-parallel-size > 1")
        first, stages = (split, pp_size - split) if split_stack == "decoder" else (0, split)
        if config.num_layers % stages != 0:
            raise ValueError(f"--{split_stack}-num-layers ({config.num_layers}) must be divisible by its {stages} "
                             f"pipeline stages (--pipeline-model-parallel-split-rank {split} of "
                             f"--pipeline-model-parallel-size {pp_size})")
        per_stage = config.num_layers // stages
        return per_stage, (pp_rank - first) * per_stage
    if config.num_layers % pp_size != 0:
        raise ValueError(
            f"--num-layers ({config.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp_size})"
        )
    per_stage = config.num_layers // pp_size
    vp_size = getattr(pp_state, "virtual_pp_size", None) if pp_state is not None else None
    if vp_size is not None and vp_size > 1:
        if per_stage % vp_size != 0:
            raise ValueError(
                f"layers per pipeline stage ({per_stage}) must be divisible by "
                f"--num-layers-per-virtual-pipeline-stage chunks ({vp_size})"
            )
        per_chunk = per_stage // vp_size
        vp_rank = getattr(pp_state, "virtual_pp_rank", 0) or 0
        return per_chunk, vp_rank * (config.num_layers // vp_size) + pp_rank * per_chunk
    return per_stage, pp_rank * per_stage


class ParallelTransformer(MegatronModule):
    """The layer stack of one pipeline stage (or model chunk), with the final LayerNorm on the last stage."""

    def __init__(
        self,
        config: TransformerConfig,
        tp_group: Optional[Any] = None,
        pp_state: Optional[Any] = None,
        layer_type: LayerType = LayerType.encoder,
        self_attn_mask_type: AttnMaskType = AttnMaskType.padding,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        spec: Optional[TransformerLayerSpec] = None,
        split_stack: Optional[str] = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_type = layer_type
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.input_tensor: Optional[torch.Tensor] = None
        self.sequence_parallel = config.sequence_parallel
        self.recompute_granularity = config.recompute_granularity
        self.recompute_method = config.recompute_method
        self.recompute_num_layers = config.recompute_num_layers or 1
        self.distribute_saved_activations = config.distribute_saved_activations and not config.sequence_parallel
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(
                f"--recompute-granularity must be 'full' or 'selective', got {self.recompute_granularity!r}"
            )
        if self.recompute_granularity == "full" and self.recompute_method not in ("uniform", "block"):
            raise ValueError(
                "--recompute-granularity full needs --recompute-method uniform or block "
                f"(got {self.recompute_method!r})"
            )

        self.tp_group = tp_group
        # the named losses this model's layers record (the loop logs them; every stage declares them, see
        # megatron/core/aux_losses.py)
        self.aux_losses = router_losses(config, tp_group)
        self.num_layers, offset = layers_on_this_stage(config, pp_state, split_stack)
        self.layers = torch.nn.ModuleList(
            [
                ParallelTransformerLayer(config, i + 1 + offset, tp_group, layer_type, self_attn_mask_type, spec=spec)
                for i in range(self.num_layers)
            ]
        )
        if config.context_parallel_size > 1:  # the sequence is split: self-attention runs over the CP group
            cp_group = getattr(pp_state, "cp_group", None)
            if group_size(cp_group) != config.context_parallel_size:
                raise ValueError(f"config.context_parallel_size={config.context_parallel_size} but the context-"
                                 f"parallel group has {group_size(cp_group)} ranks; pass pp_state=parallel_state")
            for layer in self.layers:
                layer.self_attention.set_context_parallel(cp_group)
        if self.post_process and self.post_layer_norm:
            self.final_layernorm = build_norm(config)

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """Activation received from the previous pipeline stage (used instead of the forward's hidden_states)."""
        self.input_tensor = input_tensor

    def _dropout_active(self) -> bool:
        return self.training and (self.config.hidden_dropout > 0 or self.config.attention_dropout > 0)

    def _checkpointed_forward(self, hidden_states, attention_mask, encoder_output, enc_dec_attn_mask,
                              packed_seq_params=None):
        def custom(start: int, end: int):
            def custom_forward(x, mask, enc_out, enc_mask):
                for layer in self.layers[start:end]:
                    x = layer(x, mask, encoder_output=enc_out, enc_dec_attn_mask=enc_mask,
                              packed_seq_params=packed_seq_params)
                return x

            return custom_forward

        n = self.recompute_num_layers
        if self.recompute_method == "uniform":
            start = 0
            while start < self.num_layers:
                hidden_states = tensor_parallel.checkpoint(
                    custom(start, start + n), self.distribute_saved_activations,
                    hidden_states, attention_mask, encoder_output, enc_dec_attn_mask, tp_group=self.tp_group,
                )
                start += n
        else:  # block: recompute the first n layers of this stage, keep the rest's activations
            for i in range(self.num_layers):
                if i < n:
                    hidden_states = tensor_parallel.checkpoint(
                        custom(i, i + 1), self.distribute_saved_activations,
                        hidden_states, attention_mask, encoder_output, enc_dec_attn_mask, tp_group=self.tp_group,
                    )
                else:
                    hidden_states = custom(i, i + 1)(hidden_states, attention_mask, encoder_output, enc_dec_attn_mask)
        return hidden_states

    def forward(
        self,
        hidden_states: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        encoder_output: Optional[torch.Tensor] = None,
        enc_dec_attn_mask: Optional[torch.Tensor] = None,
        inference_params: Optional[InferenceParams] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if not self.pre_process:
            if self.input_tensor is None:
                raise RuntimeError("ParallelTransformer on a non-first pipeline stage: call set_input_tensor() first")
            hidden_states = self.input_tensor
        # Under sequence parallelism each TP rank holds a different slice of the sequence: its dropout masks must
        # differ, so the whole stack runs under the model-parallel RNG (Megatron does the same).
        with model_parallel_rng_fork(self.sequence_parallel and self._dropout_active()):
            if (
                self.recompute_granularity == "full"
                and self.training
                and torch.is_grad_enabled()
                and inference_params is None
            ):
                hidden_states = self._checkpointed_forward(
                    hidden_states, attention_mask, encoder_output, enc_dec_attn_mask, packed_seq_params
                )
            else:
                for layer in self.layers:
                    hidden_states = layer(
                        hidden_states,
                        attention_mask,
                        encoder_output=encoder_output,
                        enc_dec_attn_mask=enc_dec_attn_mask,
                        inference_params=inference_params,
                        packed_seq_params=packed_seq_params,
                    )
        if self.post_process and self.post_layer_norm:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
