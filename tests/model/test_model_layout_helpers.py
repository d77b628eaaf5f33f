"""The one tp-group fallback, pipeline-size lookup and layout check that GPT, BERT and T5 share (no processes)."""
from __future__ import annotations

import types

import pytest
import torch

from megatron.layers.language_model import lm_cross_entropy
from megatron.layers.utils import check_model_layout, pp_size_of, resolve_tp_group
from megatron.models.bert.model import BertModel
from megatron.models.t5.model import T5Model
from tests.model.helpers import tiny_config


def test_resolve_tp_group_and_pp_size_of() -> None:
    state = types.SimpleNamespace(tp_group="tp-of-state", pp_size=4)
    assert resolve_tp_group("given", state) == "given"
    assert resolve_tp_group(None, state) == "tp-of-state"
    assert resolve_tp_group(None, None) is None
    assert resolve_tp_group(None, types.SimpleNamespace()) is None
    assert (pp_size_of(state), pp_size_of(None), pp_size_of(types.SimpleNamespace())) == (4, 1, 1)


@pytest.mark.parametrize("model_cls", [BertModel, T5Model])
def test_every_family_refuses_a_bad_layout_naming_itself(model_cls) -> None:
    with pytest.raises(ValueError, match="padded_vocab_size is not set"):
        model_cls(tiny_config(padded_vocab_size=0))
    with pytest.raises(ValueError, match=f"{model_cls.__name__}: config.tensor_model_parallel_size=2"):
        model_cls(tiny_config(tensor_model_parallel_size=2))
    assert check_model_layout(model_cls.__name__, tiny_config(), None, None) == 1
    with pytest.raises(ValueError, match="pp_state has pp_size=1"):
        check_model_layout("GPTModel", tiny_config(pipeline_model_parallel_size=2), None, None)


def test_lm_cross_entropy_is_the_per_token_loss() -> None:
    logits = torch.randn(5, 2, 11)  # [s, b, v]
    labels = torch.randint(0, 11, (2, 5))  # [b, s]
    expected = torch.nn.functional.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")
    torch.testing.assert_close(lm_cross_entropy(logits, labels), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="fp16-lm-cross-entropy needs fp16 logits"):
        lm_cross_entropy(logits, labels, fp16_lm_cross_entropy=True)
