"""BERT model: Hugging Face `MegatronBertForPreTraining` parity (prediction and sentence-order logits at non-pad
positions, with and without the binary head, erf and tanh GeLU, TP=1 and TP=2 (+SP)), Megatron's checkpoint keys,
the padding mask, the parameter count of Megatron's unit-test vector, and the HF state-dict mapping round trip.
"""
from __future__ import annotations

import pytest
import torch

from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer_config import TransformerConfig
from megatron.models.bert.hf import (
    hf_megatron_bert_activation,
    hf_megatron_bert_config_kwargs,
    hf_to_megatron_bert_state_dict,
    megatron_bert_to_hf_state_dict,
)
from megatron.models.bert.model import BertModel, bert_extended_attention_mask
from megatron.models.gpt.model import flatten_checkpoint_state_dict
from tests.dist_utils import run_distributed

VOCAB, SEQ, TOL = 64, 12, 1e-5


def bert_config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=VOCAB,
                  max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, bias_gelu_fusion=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_bert(config: TransformerConfig, binary: bool, seed: int = 1234, **kwargs) -> BertModel:
    model_parallel_manual_seed(seed, 0)
    torch.manual_seed(seed)
    return BertModel(config, num_tokentypes=2 if binary else 0, add_binary_head=binary, **kwargs).eval()


def bert_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, padding mask (row 1 padded from 8), token types, labels (-1 outside 3 masked positions per row)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    pad = torch.ones(2, SEQ, dtype=torch.long)
    pad[1, 8:] = 0
    types = torch.zeros(2, SEQ, dtype=torch.long)
    types[:, 5:] = 1
    labels = torch.full((2, SEQ), -1, dtype=torch.long)
    labels[:, [1, 4, 6]] = torch.randint(0, VOCAB, (2, 3), generator=g)
    return tokens, pad, types, labels


def hf_outputs(model: BertModel, config: TransformerConfig, binary: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import MegatronBertConfig, MegatronBertForPreTraining

    hf = MegatronBertForPreTraining(MegatronBertConfig(**hf_megatron_bert_config_kwargs(config))).eval()
    missing, unexpected = hf.load_state_dict(megatron_bert_to_hf_state_dict(model.state_dict_for_save_checkpoint(),
                                                                            config), strict=False)
    assert not unexpected
    assert set(missing) == (set() if binary else {"bert.pooler.dense.weight", "bert.pooler.dense.bias",
                                                  "cls.seq_relationship.weight", "cls.seq_relationship.bias"})
    tokens, pad, types, _ = bert_batch()
    with torch.no_grad():
        out = hf(input_ids=tokens, attention_mask=pad, token_type_ids=types if binary else None)
    return out.prediction_logits, out.seq_relationship_logits


def assert_close_at_tokens(ours: torch.Tensor, ref: torch.Tensor) -> None:
    keep = bert_batch()[1].bool()
    err = (ours[keep] - ref[keep]).abs().max().item()
    assert err <= TOL, err


@pytest.mark.parametrize("binary", [True, False], ids=["binary-head", "no-binary-head"])
@pytest.mark.parametrize("act", ["erf", "openai-gelu"])
def test_logits_equal_hf_megatron_bert(binary: bool, act: str) -> None:
    config = bert_config(openai_gelu=act == "openai-gelu")
    model = build_bert(config, binary)
    tokens, pad, types, _ = bert_batch()
    with torch.no_grad():
        logits, sop = model(tokens, pad, tokentype_ids=types if binary else None)
    hf_logits, hf_sop = hf_outputs(model, config, binary)
    assert logits.shape == (2, SEQ, VOCAB)
    assert_close_at_tokens(logits, hf_logits)
    if binary:
        assert (sop - hf_sop).abs().max().item() <= TOL
    else:
        assert sop is None


def test_hf_activation_follows_megatron_flags() -> None:
    assert hf_megatron_bert_activation(bert_config()) == "gelu"
    assert hf_megatron_bert_activation(bert_config(openai_gelu=True)) == "gelu_new"
    with pytest.raises(ValueError, match="--no-bias-gelu-fusion"):  # Megatron's default MLP is tanh, its head erf
        hf_megatron_bert_activation(bert_config(bias_gelu_fusion=True))


def test_checkpoint_keys_are_megatrons_and_hf_mapping_round_trips() -> None:
    config = bert_config()
    model = build_bert(config, True)
    nested = model.state_dict_for_save_checkpoint()
    assert sorted(nested) == ["binary_head", "language_model", "lm_head"]
    assert sorted(nested["lm_head"]) == ["bias", "dense.bias", "dense.weight", "layernorm.bias", "layernorm.weight"]
    assert sorted(nested["language_model"]) == ["embedding", "encoder", "pooler"]
    assert sorted(nested["language_model"]["embedding"]) == ["position_embeddings", "tokentype_embeddings",
                                                             "word_embeddings"]
    assert "final_layernorm.weight" in nested["language_model"]["encoder"]
    flat = flatten_checkpoint_state_dict(nested)
    assert "language_model.pooler.dense.weight" in flat and "binary_head.weight" in flat
    assert not any("embedding.layernorm" in k or "embedding.norm" in k for k in flat)  # no embedding LayerNorm
    hf = megatron_bert_to_hf_state_dict(nested, config)
    back = hf_to_megatron_bert_state_dict(hf, config)
    assert set(back) == set(flat) and all(torch.equal(back[k], flat[k]) for k in flat)
    other = build_bert(config, True, seed=5)
    other.load_state_dict(nested)  # Megatron's nested dict loads
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))

    plain = build_bert(config, False).state_dict_for_save_checkpoint()
    assert sorted(plain) == ["language_model", "lm_head"]
    assert "pooler" not in plain["language_model"] and "tokentype_embeddings" not in plain["language_model"]["embedding"]


def test_padding_mask_masks_padded_keys_and_queries() -> None:
    pad = torch.tensor([[1, 1, 1, 0]])
    mask = bert_extended_attention_mask(pad)
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == torch.bool
    assert not mask[0, 0, :3, :3].any() and mask[0, 0, :, 3].all() and mask[0, 0, 3, :].all()


def test_parameter_count_of_megatrons_unit_test_vector() -> None:
    # Megatron-LM tests/unit_tests/models/test_bert_model.py config with classic tied weights: 5502 by hand
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4, padded_vocab_size=100,
                               max_position_embeddings=4)
    model = BertModel(config, num_tokentypes=0, add_binary_head=True)
    assert sum(p.numel() for p in model.parameters()) == 5502


def test_masked_lm_loss_ignores_minus_one_labels() -> None:
    config = bert_config()
    model = build_bert(config, True)
    tokens, pad, types, labels = bert_batch()
    with torch.no_grad():
        logits, _ = model(tokens, pad, tokentype_ids=types)
        loss, _ = model(tokens, pad, tokentype_ids=types, lm_labels=labels)
    keep = labels >= 0
    ref = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="none")
    assert torch.allclose(loss[keep], ref, atol=1e-5)


def _tp2_worker(rank: int, world_size: int, cases: list[tuple[bool, bool]]) -> list[dict]:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out = [_tp2_case(ps.get_parallel_state(), binary, sp) for binary, sp in cases]
    ps.destroy_model_parallel()
    return out


def _tp2_case(state, binary: bool, sequence_parallel: bool) -> dict:
    from megatron.layers.tp_shards import split_tensor_parallel_state_dict, tensor_parallel_layouts

    full = build_bert(bert_config(), binary)
    config = bert_config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
    model_parallel_manual_seed(99, state.tp_rank)
    tp_model = BertModel(config, pp_state=state, num_tokentypes=2 if binary else 0, add_binary_head=binary,
                         parallel_output=False).eval()
    shards = split_tensor_parallel_state_dict(full.state_dict(), 2, layouts=tensor_parallel_layouts(tp_model))
    tp_model.load_state_dict(shards[state.tp_rank])
    tokens, pad, types, labels = bert_batch()
    with torch.no_grad():
        logits, sop = tp_model(tokens, pad, tokentype_ids=types if binary else None)
        tp_model.parallel_output = tp_model.lm_head.parallel_output = True
        loss, _ = tp_model(tokens, pad, tokentype_ids=types if binary else None, lm_labels=labels)
        ref_loss, _ = full(tokens, pad, tokentype_ids=types if binary else None, lm_labels=labels)
    hf_logits, hf_sop = hf_outputs(full, bert_config(), binary)
    return {"logits": logits, "sop": sop, "hf_logits": hf_logits, "hf_sop": hf_sop,
            "loss_err": (loss - ref_loss)[labels >= 0].abs().max().item()}


def test_tp2_logits_equal_hf() -> None:
    cases = [(True, True), (False, False)]  # (binary head, sequence parallel)
    for rank_results in run_distributed(_tp2_worker, 2, args=(cases,)):
        for (binary, _sp), res in zip(cases, rank_results):
            assert_close_at_tokens(res["logits"], res["hf_logits"])
            if binary:
                assert (res["sop"] - res["hf_sop"]).abs().max().item() <= TOL
            assert res["loss_err"] <= TOL
