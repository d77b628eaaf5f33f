"""BERT finetuning heads (Megatron's Classification): the BERT language model with its pooler -> dropout -> a head.

`BertTaskModel` is the shared part of `Classification` (here) and `MultipleChoice` (multiple_choice.py): the same
`TransformerLanguageModel` BertModel builds (bert_layer_spec, padding mask, token types, pooler) and Megatron's
checkpoint keys ``language_model`` + ``classification_head`` / ``multichoice_head``. Loading a pretrained BERT takes
only ``language_model`` (the LM and binary heads are dropped); a missing task head, a missing pooler (a BERT trained
with --bert-no-binary-head; Megatron asserts there) or missing token-type rows keep their fresh initialisation and
print a notice.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.checkpoint_keys import LANGUAGE_MODEL_KEY, flatten_checkpoint_state_dict
from megatron.layers.enums import AttnMaskType
from megatron.layers.language_model import TransformerLanguageModel
from megatron.layers.module import MegatronModule
from megatron.layers.utils import get_linear_layer, resolve_tp_group
from megatron.models.bert.layer_spec import bert_layer_spec
from megatron.models.bert.model import bert_extended_attention_mask, bert_position_ids

CLASSIFICATION_HEAD_KEY = "classification_head"


def _notice(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


class BertTaskModel(MegatronModule):
    """BERT encoder + pooler + dropout + `head_key` (built by the subclass as ``self.<head_key>``)."""

    head_key = ""

    def __init__(self, config: TransformerConfig, *, tp_group: Optional[Any] = None, pp_state: Optional[Any] = None,
                 num_tokentypes: int = 2, pre_process: bool = True, post_process: bool = True) -> None:
        super().__init__(config=config, share_embeddings_and_output_weights=False)
        tp_group = resolve_tp_group(tp_group, pp_state)
        self.pre_process = pre_process
        self.post_process = post_process
        self.language_model = TransformerLanguageModel(
            config, tp_group, pp_state, encoder_attn_mask_type=AttnMaskType.padding, num_tokentypes=num_tokentypes,
            add_pooler=True, pre_process=pre_process, post_process=post_process,
            encoder_layer_spec=bert_layer_spec(config))
        if post_process:
            self.head_dropout = torch.nn.Dropout(config.hidden_dropout)

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def encode(self, tokens: Optional[torch.Tensor], padding_mask: torch.Tensor,
               tokentype_ids: Optional[torch.Tensor]) -> Any:
        """[b, s] inputs -> dropout(pooled) [b, h] on the last stage, the hidden states elsewhere."""
        extended = bert_extended_attention_mask(padding_mask)
        position_ids = bert_position_ids(tokens) if self.pre_process else None
        out = self.language_model(tokens, position_ids, extended, tokentype_ids=tokentype_ids)
        if not self.post_process:
            return out
        _, pooled = out
        return self.head_dropout(pooled)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        out: dict = {LANGUAGE_MODEL_KEY: self.language_model.state_dict_for_save_checkpoint(prefix=prefix,
                                                                                             keep_vars=keep_vars)}
        if self.post_process:
            out[self.head_key] = getattr(self, self.head_key).state_dict(prefix=prefix, keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """A finetuning checkpoint (strict) or a pretrained BERT: `language_model` only, fresh head/pooler noticed."""
        flat = flatten_checkpoint_state_dict(state_dict)
        own = self.state_dict()
        flat = {k: v for k, v in flat.items() if k in own}  # drops lm_head, binary_head, word_embeddings
        missing = [k for k in own if k not in flat and not k.endswith("._extra_state")]
        if self.post_process and any(k.startswith(self.head_key + ".") for k in missing):
            _notice(f" > could not find {self.head_key} in the checkpoint, initializing to random (a new head for "
                    "this task, as expected when finetuning a pretrained BERT)")
        if any(k.startswith(LANGUAGE_MODEL_KEY + ".pooler.") for k in missing):
            _notice("***WARNING*** the checkpoint has no pooler (a BERT pretrained with --bert-no-binary-head): "
                    "the pooler starts from a fresh initialization")
        if any(".tokentype_embeddings." in k for k in missing):
            _notice("***WARNING*** expected tokentype embeddings in the checkpoint but could not find it")
        optional = (self.head_key + ".", LANGUAGE_MODEL_KEY + ".pooler.")
        required = [k for k in missing if not k.startswith(optional) and ".tokentype_embeddings." not in k]
        if strict and required:
            raise RuntimeError(f"the checkpoint lacks {len(required)} tensors of the BERT encoder, e.g. {required[0]}: "
                           "is it a BERT checkpoint with the same --num-layers/--hidden-size?")
        return super().load_state_dict(flat, strict=False, assign=assign)


class Classification(BertTaskModel):
    """Megatron's Classification: logits [b, num_classes] (MNLI 3, QQP 2); hidden states on non-last stages."""

    head_key = CLASSIFICATION_HEAD_KEY

    def __init__(self, config: TransformerConfig, num_classes: int, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.num_classes = num_classes
        if self.post_process:
            self.classification_head = get_linear_layer(config.hidden_size, num_classes, config.init_method)

    def forward(self, tokens: Optional[torch.Tensor], padding_mask: torch.Tensor,
                tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.encode(tokens, padding_mask, tokentype_ids)
        if not self.post_process:
            return out
        return self.classification_head(out)
