"""GPT: the transformer language model with causal attention and logits through the tied word embedding."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.checkpoint_keys import (  # noqa: F401 - Megatron's names, also importable from here
    LANGUAGE_MODEL_KEY,
    MTP_KEY,
    OUTPUT_COPY,
    WORD_EMBEDDINGS_FOR_HEAD_KEY,
    flatten_checkpoint_state_dict,
)
from megatron.layers.enums import AttnMaskType
from megatron.layers.language_model import TransformerLanguageModel, lm_cross_entropy, parallel_lm_logits
from megatron.layers.module import MegatronModule
from megatron.layers.mtp import MultiTokenPredictionBlock, embed_with_copy, output_logits
from megatron.layers.utils import check_model_layout, resolve_tp_group
from megatron.models.gpt.layer_spec import gpt_layer_spec


def post_language_model_processing(
    lm_output: torch.Tensor,
    labels: Optional[torch.Tensor],
    logit_weights: torch.Tensor,
    parallel_output: bool,
    fp16_lm_cross_entropy: bool,
    tp_group: Optional[Any] = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """Hidden states [s, b, h] -> logits [b, s, v(/tp)] when labels is None, else per-token loss [b, s]."""
    output = parallel_lm_logits(lm_output, logit_weights, parallel_output, tp_group, sequence_parallel=sequence_parallel)
    if labels is None:
        return output.transpose(0, 1).contiguous()
    return lm_cross_entropy(output, labels, tp_group, fp16_lm_cross_entropy)


class GPTModel(MegatronModule):
    """Megatron's GPT model; see the module docstring of megatron.model for the parameter names."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        tp_group: Optional[Any] = None,
        pp_state: Optional[Any] = None,
        num_tokentypes: int = 0,
        parallel_output: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
    ) -> None:
        super().__init__(config=config, share_embeddings_and_output_weights=config.share_embeddings_and_output_weights)
        tp_group = resolve_tp_group(tp_group, pp_state)
        check_model_layout("GPTModel", config, tp_group, pp_state)
        self.tp_group = tp_group
        self.pp_state = pp_state
        self.parallel_output = parallel_output
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.sequence_parallel = config.sequence_parallel
        spec = gpt_layer_spec(config)
        self.language_model = TransformerLanguageModel(
            config,
            tp_group,
            pp_state,
            encoder_attn_mask_type=AttnMaskType.causal,
            num_tokentypes=num_tokentypes,
            add_pooler=False,
            pre_process=pre_process,
            post_process=post_process,
            encoder_layer_spec=spec,
        )
        if self.share_embeddings_and_output_weights or config.mtp_num_layers:
            self.initialize_word_embeddings(tp_group, pp_state)
        # multi-token prediction (megatron/layers/mtp.py): its layers on the last stage, its named losses on every one
        self.mtp = (MultiTokenPredictionBlock(config, tp_group, spec, build_layers=post_process)
                    if config.mtp_num_layers else None)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Activation from the previous pipeline stage."""
        self.language_model.set_input_tensor(input_tensor)

    def output_weight(self) -> torch.Tensor:
        """Weight of the output layer: the (tied) word embedding, or the untied output layer."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.language_model.output_layer.weight

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        labels: Optional[torch.Tensor] = None,
        inference_params: Optional[Any] = None,
        tokentype_ids: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """Logits [b, s, v/tp] (labels None) or per-token loss [b, s]; hidden states [s, b, h] on non-last stages.
        With --mtp-num-layers, training with labels also attaches the MTP losses (`loss_mask` [b, s]: the tokens
        they count; None: all). `packed_seq_params`: several documents per row (megatron/core/packed_seq_params.py)
        -- attention stays inside each, positions restart (None `position_ids`: computed from it, without CP)."""
        if packed_seq_params is not None:
            position_ids = self._packed_positions(input_ids, position_ids, packed_seq_params)
        lm_output = self.language_model(
            input_ids, position_ids, attention_mask, tokentype_ids=tokentype_ids, inference_params=inference_params,
            packed_seq_params=packed_seq_params,
        )
        if not self.post_process:
            return lm_output
        if self.mtp is not None and labels is not None and self.training:
            lm_output = self._attach_mtp_losses(lm_output, input_ids, position_ids, attention_mask, labels, loss_mask)
        return post_language_model_processing(
            lm_output,
            labels,
            self.output_weight(),
            self.parallel_output,
            self.fp16_lm_cross_entropy,
            self.tp_group,
            self.sequence_parallel,
        )

    def _packed_positions(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                          packed: PackedSeqParams) -> Optional[torch.Tensor]:
        """The position ids of packed rows: as given, or restarting per document (one-line errors for what packed
        rows do not run with)."""
        if self.mtp is not None:
            raise ValueError("packed sequences (cu_seqlens) with --mtp-num-layers are not supported; train the "
                             "multi-token-prediction model on unpacked rows")
        if position_ids is not None or input_ids is None:
            return position_ids
        if self.config.context_parallel_size > 1:
            raise ValueError("packed rows under context parallelism need this rank's position_ids "
                             "(slice packed.position_ids with slice_for_cp)")
        return packed.position_ids(input_ids.size(0), input_ids.size(1), input_ids.device)

    def _attach_mtp_losses(self, lm_output: torch.Tensor, input_ids: torch.Tensor,
                           position_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                           labels: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The decoder's output with the MTP depths' losses attached (megatron/layers/mtp.py)."""
        if self.pre_process:
            embed = self.language_model.embedding
        else:
            embed = embed_with_copy(self.word_embeddings, self.config, self.tp_group, self.training)
        states = self.mtp(input_ids, position_ids, lm_output, attention_mask, embed)
        logits = output_logits(self.output_weight(), self.tp_group, self.sequence_parallel)
        return self.mtp.attach_losses(lm_output, states, labels, loss_mask, logits, self.fp16_lm_cross_entropy)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """Megatron's nested layout: {'language_model': {'embedding': …, 'encoder': …}[, 'word_embeddings_for_head']}."""
        out = {
            LANGUAGE_MODEL_KEY: self.language_model.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        }
        if self.post_process and not self.pre_process and getattr(self, "word_embeddings", None) is not None:
            out[WORD_EMBEDDINGS_FOR_HEAD_KEY] = self.word_embeddings.state_dict(prefix=prefix, keep_vars=keep_vars)
        if self.mtp is not None and len(self.mtp.layers):
            out[MTP_KEY] = self.mtp.state_dict(prefix=prefix, keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load Megatron's nested checkpoint dict or a flat `state_dict()`."""
        flat = flatten_checkpoint_state_dict(state_dict)
        # Checkpoints never store non-persistent extras; drop Megatron's optional '_extra_state' entries we lack.
        own = set(self.state_dict().keys())
        flat = {k: v for k, v in flat.items() if not (k.endswith("._extra_state") and k not in own)}
        # Megatron reads the head's copy of the embeddings only on a last stage without the embedding (HF's Megatron
        # tool writes it on every last stage): elsewhere it is ignored, strict or not.
        if "word_embeddings.weight" in flat and "word_embeddings.weight" not in own:
            del flat["word_embeddings.weight"]
        # Megatron Core keeps that copy as `output_layer.weight` (tied embeddings on a last stage without them)
        if OUTPUT_COPY in flat and OUTPUT_COPY not in own and "word_embeddings.weight" in own:
            flat["word_embeddings.weight"] = flat.pop(OUTPUT_COPY)
        return super().load_state_dict(flat, strict=strict, assign=assign)
