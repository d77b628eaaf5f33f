"""Finetuning heads: Classification / MultipleChoice logits equal Hugging Face MegatronBertForSequenceClassification
/ MegatronBertForMultipleChoice on converted weights (1e-5, with padding), Megatron's checkpoint keys, and loading
a pretrained BERT: the LM/binary heads are dropped, a missing task head or pooler (--bert-no-binary-head) keeps its
fresh initialisation with a notice, and a checkpoint missing encoder tensors is a one-line error.
"""
from __future__ import annotations

import pytest
import torch

from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.models.bert.classification import Classification
from megatron.models.bert.hf import hf_megatron_bert_config_kwargs, megatron_bert_to_hf_state_dict
from megatron.models.bert.model import BertModel
from megatron.models.bert.multiple_choice import MultipleChoice
from tests.model.test_bert_model import VOCAB, bert_config

TOL = 1e-5


def hf_encoder_state(task_model: torch.nn.Module, config) -> dict:
    """Our task model's encoder + pooler as HF `bert.*` tensors (the converter's mapping; no LM head needed)."""
    sd = task_model.state_dict()
    fake = {**sd, "lm_head.dense.weight": torch.zeros(1), "lm_head.dense.bias": torch.zeros(1),
            "lm_head.layernorm.weight": torch.zeros(1), "lm_head.layernorm.bias": torch.zeros(1),
            "lm_head.bias": torch.zeros(1), "binary_head.weight": torch.zeros(1), "binary_head.bias": torch.zeros(1)}
    return {k: v for k, v in megatron_bert_to_hf_state_dict(fake, config).items() if k.startswith("bert.")}


def batch(choices: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (3, choices, 12) if choices else (3, 12)
    tokens = torch.randint(0, VOCAB, shape, generator=g)
    pad = torch.ones(shape, dtype=torch.long)
    pad[..., 1, 7:] = 0 if not choices else 1
    pad[1, ..., 9:] = 0
    types = torch.zeros(shape, dtype=torch.long)
    types[..., 4:] = 1
    return tokens, pad, types * pad


def _perturb(model: torch.nn.Module) -> None:
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p)) if "layernorm" in name else p.mul_(3.0)


def test_classification_equals_hf_sequence_classification() -> None:
    from transformers import MegatronBertConfig, MegatronBertForSequenceClassification

    config = bert_config()
    model_parallel_manual_seed(5, 0)
    torch.manual_seed(5)
    ours = Classification(config, 3).eval()
    _perturb(ours)
    keys = ours.state_dict_for_save_checkpoint()
    assert sorted(keys) == ["classification_head", "language_model"]
    assert sorted(keys["language_model"]) == ["embedding", "encoder", "pooler"]
    hf = MegatronBertForSequenceClassification(MegatronBertConfig(**hf_megatron_bert_config_kwargs(config),
                                                                  num_labels=3)).eval()
    sd = hf_encoder_state(ours, config)
    sd["classifier.weight"], sd["classifier.bias"] = ours.classification_head.weight, ours.classification_head.bias
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    tokens, pad, types = batch()
    with torch.no_grad():
        mine = ours(tokens, pad, tokentype_ids=types)
        ref = hf(input_ids=tokens, attention_mask=pad, token_type_ids=types).logits
    assert mine.shape == (3, 3)
    assert (mine - ref).abs().max().item() <= TOL


def test_multiple_choice_equals_hf_multiple_choice() -> None:
    from transformers import MegatronBertConfig, MegatronBertForMultipleChoice

    config = bert_config(openai_gelu=True)
    model_parallel_manual_seed(6, 0)
    torch.manual_seed(6)
    ours = MultipleChoice(config).eval()
    _perturb(ours)
    assert sorted(ours.state_dict_for_save_checkpoint()) == ["language_model", "multichoice_head"]
    hf = MegatronBertForMultipleChoice(MegatronBertConfig(**hf_megatron_bert_config_kwargs(config))).eval()
    sd = hf_encoder_state(ours, config)
    sd["classifier.weight"], sd["classifier.bias"] = ours.multichoice_head.weight, ours.multichoice_head.bias
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    tokens, pad, types = batch(choices=4)
    with torch.no_grad():
        mine = ours(tokens, pad, tokentype_ids=types)
        ref = hf(input_ids=tokens, attention_mask=pad, token_type_ids=types).logits
    assert mine.shape == (3, 4)
    assert (mine - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("binary", [True, False], ids=["pretrained-with-pooler", "bert-no-binary-head"])
def test_loading_a_pretrained_bert(binary: bool, capsys: pytest.CaptureFixture) -> None:
    config = bert_config()
    torch.manual_seed(1)
    bert = BertModel(config, num_tokentypes=2 if binary else 0, add_binary_head=binary)
    torch.manual_seed(2)
    clf = Classification(config, 2)
    fresh_pooler = clf.language_model.pooler.dense.weight.detach().clone()
    clf.load_state_dict(bert.state_dict_for_save_checkpoint())
    out = capsys.readouterr().out
    assert " > could not find classification_head in the checkpoint, initializing to random (a new head" in out
    assert ("has no pooler" in out) is (not binary)
    assert ("expected tokentype embeddings" in out) is (not binary)
    ours, theirs = clf.state_dict(), bert.state_dict()
    for name, value in theirs.items():
        if name.startswith("language_model."):
            assert torch.equal(ours[name], value), name
    if not binary:
        assert torch.equal(clf.language_model.pooler.dense.weight, fresh_pooler)
    # a finetuning checkpoint round-trips with its head; a checkpoint missing encoder tensors is one line
    again = Classification(config, 2)
    again.load_state_dict(clf.state_dict_for_save_checkpoint())
    assert "classification_head" not in capsys.readouterr().out
    assert torch.equal(again.classification_head.weight, clf.classification_head.weight)
    broken = clf.state_dict_for_save_checkpoint()
    del broken["language_model"]["encoder"]["layers.1.mlp.dense_4h_to_h.weight"]
    with pytest.raises(RuntimeError, match="lacks 1 tensors of the BERT encoder"):
        Classification(config, 2).load_state_dict(broken)
