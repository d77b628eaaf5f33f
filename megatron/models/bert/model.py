"""BERT (Megatron's BertModel): a pre-LN encoder with padding masks, the masked-LM head and the sentence-order head.

Built from the same parts as GPT (layer_specs.bert_layer_spec = GPT's layer with bidirectional attention): word +
position (+ token-type, with the binary head) embeddings and no embedding LayerNorm, pre-LN layers and a final
LayerNorm, pooler ``tanh(dense(h[0]))`` (gathers the sequence under SP), LM head ``dense -> erf GeLU -> LayerNorm ->``
tied word embeddings ``+`` a vocab-parallel bias, binary head ``Linear(h, 2)`` on the pooled output.

Checkpoint layout as Megatron's: ``language_model`` (``embedding.{word,position,tokentype}_embeddings``,
``encoder``, ``pooler.dense``), ``lm_head`` (``bias``, ``dense.*``, ``layernorm.*``), ``binary_head``, and
``word_embeddings_for_head`` on a last pipeline stage without the embedding.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.checkpoint_keys import (
    LANGUAGE_MODEL_KEY,
    WORD_EMBEDDINGS_FOR_HEAD_KEY,
    flatten_checkpoint_state_dict,
)
from megatron.layers.enums import AttnMaskType
from megatron.layers.fused_layer_norm import MixedFusedLayerNorm
from megatron.layers.language_model import (
    TiedLMHeadWithBias,
    TransformerLanguageModel,
    lm_cross_entropy,
    sequential_position_ids,
)
from megatron.layers.module import MegatronModule
from megatron.layers.utils import check_model_layout, get_linear_layer, openai_gelu, resolve_tp_group
from megatron.models.bert.layer_spec import bert_layer_spec

LM_HEAD_KEY = "lm_head"
BINARY_HEAD_KEY = "binary_head"


def bert_extended_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] (1 = token, 0 = pad) -> bool [b, 1, s, s], True = masked; padded query rows are fully masked."""
    pad = padding_mask.float()
    return (pad.unsqueeze(1) * pad.unsqueeze(2) < 0.5).unsqueeze(1)


bert_position_ids = sequential_position_ids  # Megatron's name


class BertLMHead(TiedLMHeadWithBias):
    """dense -> GeLU (erf; tanh with --openai-gelu) -> LayerNorm -> logits through the tied embedding + bias."""

    def __init__(self, config: TransformerConfig, tp_group: Optional[Any], parallel_output: bool) -> None:
        super().__init__(config, tp_group, parallel_output)
        self.dense = get_linear_layer(config.hidden_size, config.hidden_size, config.init_method)
        for p in self.dense.parameters():  # sees this rank's sequence slice under SP: grads summed over TP
            p.sequence_parallel = config.sequence_parallel
        self.layernorm = MixedFusedLayerNorm(config.hidden_size, eps=config.layernorm_epsilon,
                                             sequence_parallel=config.sequence_parallel,
                                             params_dtype=config.params_dtype)
        self.gelu = openai_gelu if config.openai_gelu else F.gelu

    def forward(self, hidden_states: torch.Tensor, word_embeddings_weight: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] -> logits [s, b, vocab/tp] (full vocab unless parallel_output)."""
        return self.logits(self.layernorm(self.gelu(self.dense(hidden_states))), word_embeddings_weight)


def _check_layout(config: TransformerConfig, tp_group: Optional[Any], pp_state: Optional[Any]) -> None:
    check_model_layout("BertModel", config, tp_group, pp_state)
    if not config.share_embeddings_and_output_weights:
        raise ValueError("BERT ties its output layer to the word embeddings: drop "
                         "--untie-embeddings-and-output-weights")
    if config.position_embedding_type != "learned_absolute":
        raise ValueError("BERT uses learned absolute position embeddings: drop --position-embedding-type "
                         f"{config.position_embedding_type}")


class BertModel(MegatronModule):
    """Megatron's BertModel. forward(tokens, padding_mask, tokentype_ids, lm_labels) ->
    (logits [b, s, v/tp] or per-token lm loss [b, s], sop logits [b, 2] or None); hidden states on non-last stages.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        tp_group: Optional[Any] = None,
        pp_state: Optional[Any] = None,
        num_tokentypes: int = 2,
        add_binary_head: bool = True,
        parallel_output: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
    ) -> None:
        super().__init__(config=config, share_embeddings_and_output_weights=True)
        tp_group = resolve_tp_group(tp_group, pp_state)
        _check_layout(config, tp_group, pp_state)
        self.tp_group = tp_group
        self.pre_process = pre_process
        self.post_process = post_process
        self.add_binary_head = add_binary_head
        self.parallel_output = parallel_output
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.language_model = TransformerLanguageModel(
            config, tp_group, pp_state, encoder_attn_mask_type=AttnMaskType.padding, num_tokentypes=num_tokentypes,
            add_pooler=add_binary_head, pre_process=pre_process, post_process=post_process,
            encoder_layer_spec=bert_layer_spec(config),
        )
        self.initialize_word_embeddings(tp_group, pp_state)
        if post_process:
            self.lm_head = BertLMHead(config, tp_group, parallel_output)
            self.binary_head = (get_linear_layer(config.hidden_size, 2, config.init_method)
                                if add_binary_head else None)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Activation from the previous pipeline stage."""
        self.language_model.set_input_tensor(input_tensor)

    def forward(
        self,
        bert_model_input: Optional[torch.Tensor],
        attention_mask: torch.Tensor,
        tokentype_ids: Optional[torch.Tensor] = None,
        lm_labels: Optional[torch.Tensor] = None,
    ) -> Any:
        extended_mask = bert_extended_attention_mask(attention_mask)
        position_ids = bert_position_ids(bert_model_input) if self.pre_process else None
        lm_output = self.language_model(bert_model_input, position_ids, extended_mask, tokentype_ids=tokentype_ids)
        if not self.post_process:
            return lm_output
        pooled = None
        if self.add_binary_head:
            lm_output, pooled = lm_output
        logits = self.lm_head(lm_output, self.shared_embedding_or_output_weight())
        binary_logits = self.binary_head(pooled) if self.binary_head is not None else None
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous(), binary_logits
        loss = lm_cross_entropy(logits, lm_labels, self.tp_group, self.fp16_lm_cross_entropy)
        return loss, binary_logits

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """Megatron's nested layout (see the module docstring)."""
        out: dict = {LANGUAGE_MODEL_KEY: self.language_model.state_dict_for_save_checkpoint(prefix=prefix,
                                                                                             keep_vars=keep_vars)}
        if self.post_process:
            out[LM_HEAD_KEY] = self.lm_head.state_dict(prefix=prefix, keep_vars=keep_vars)
            if self.binary_head is not None:
                out[BINARY_HEAD_KEY] = self.binary_head.state_dict(prefix=prefix, keep_vars=keep_vars)
            if not self.pre_process:
                out[WORD_EMBEDDINGS_FOR_HEAD_KEY] = self.word_embeddings.state_dict(prefix=prefix, keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load Megatron's nested checkpoint dict or a flat `state_dict()`."""
        flat = flatten_checkpoint_state_dict(state_dict)
        own = set(self.state_dict().keys())
        flat = {k: v for k, v in flat.items() if not (k.endswith("._extra_state") and k not in own)}
        return super().load_state_dict(flat, strict=strict, assign=assign)
