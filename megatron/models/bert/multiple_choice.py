"""Megatron's MultipleChoice head (RACE): [b, choices, s] -> [b*choices, s] -> BERT + pooler -> dropout ->
``multichoice_head`` Linear(h, 1) -> scores [b, choices]. Shares BertTaskModel (classification.py)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.layers.utils import get_linear_layer
from megatron.models.bert.classification import BertTaskModel

MULTICHOICE_HEAD_KEY = "multichoice_head"


class MultipleChoice(BertTaskModel):
    """Scores [b, choices] on the last stage; hidden states elsewhere (inputs flattened to [b*choices, s])."""

    head_key = MULTICHOICE_HEAD_KEY

    def __init__(self, config: TransformerConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if self.post_process:
            self.multichoice_head = get_linear_layer(config.hidden_size, 1, config.init_method)

    def forward(self, tokens: Optional[torch.Tensor], padding_mask: torch.Tensor,
                tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        choices = padding_mask.size(1)
        flat = [None if t is None else t.reshape(-1, t.size(-1)) for t in (tokens, padding_mask, tokentype_ids)]
        out = self.encode(*flat)
        if not self.post_process:
            return out
        return self.multichoice_head(out).view(-1, choices)
