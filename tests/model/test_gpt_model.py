"""Single-process GPTModel tests: Megatron names and checkpoint layout, loss, SDPA vs explicit attention,
activation recomputation, KV-cache decoding and input validation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.layers import InferenceParams, ParallelTransformer
from megatron.layers.attention import CoreAttention
from megatron.models.gpt.model import GPTModel
from tests.model.helpers import VOCAB, batch, build_gpt, tiny_config

LAYER_KEYS = [
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.query_key_value.weight",
    "self_attention.query_key_value.bias",
    "self_attention.dense.weight",
    "self_attention.dense.bias",
    "post_attention_layernorm.weight",
    "post_attention_layernorm.bias",
    "mlp.dense_h_to_4h.weight",
    "mlp.dense_h_to_4h.bias",
    "mlp.dense_4h_to_h.weight",
    "mlp.dense_4h_to_h.bias",
]


def test_parameter_names_match_megatron():
    model = build_gpt(tiny_config())
    expected = ["language_model.embedding.word_embeddings.weight", "language_model.embedding.position_embeddings.weight"]
    for i in range(2):
        expected += [f"language_model.encoder.layers.{i}.{k}" for k in LAYER_KEYS]
    expected += ["language_model.encoder.final_layernorm.weight", "language_model.encoder.final_layernorm.bias"]
    assert list(model.state_dict().keys()) == expected
    qkv = model.language_model.encoder.layers[0].self_attention.query_key_value.weight
    assert tuple(qkv.shape) == (96, 32)
    assert model.shared_embedding_or_output_weight() is model.language_model.embedding.word_embeddings.weight


def test_checkpoint_layout_and_load_round_trip():
    config = tiny_config()
    model = build_gpt(config, seed=1)
    ckpt = model.state_dict_for_save_checkpoint()
    assert list(ckpt.keys()) == ["language_model"]
    lm = ckpt["language_model"]
    assert list(lm.keys()) == ["embedding", "encoder"]
    assert set(lm["embedding"]) == {"word_embeddings", "position_embeddings"}
    assert list(lm["embedding"]["word_embeddings"]) == ["weight"]
    assert "layers.1.self_attention.query_key_value.weight" in lm["encoder"]
    assert "final_layernorm.bias" in lm["encoder"]

    ids, pos, mask, _ = batch()
    model.eval()
    ref = model(ids, pos, mask)
    for state in (ckpt, model.state_dict()):
        other = build_gpt(config, seed=2).eval()
        assert not torch.equal(other(ids, pos, mask), ref)
        other.load_state_dict(state)
        assert torch.equal(other(ids, pos, mask), ref)


def test_loss_is_per_token_cross_entropy_of_logits():
    model = build_gpt(tiny_config()).eval()
    ids, pos, mask, labels = batch()
    logits = model(ids, pos, mask)
    assert logits.shape == (2, 8, VOCAB)
    loss = model(ids, pos, mask, labels=labels)
    assert loss.shape == (2, 8)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(2, 8)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def _set_sdpa(model: torch.nn.Module, allow: bool) -> None:
    for m in model.modules():
        if isinstance(m, CoreAttention):
            m.allow_sdpa = allow


@pytest.mark.parametrize("qk_scaling", [False, True])
def test_sdpa_and_explicit_attention_agree(qk_scaling):
    model = build_gpt(tiny_config(apply_query_key_layer_scaling=qk_scaling))
    ids, pos, mask, labels = batch()
    # A padding-style mask with a fully masked row: SDPA gives it Megatron's uniform row (the mean of V, no gradient
    # to q and k), as the explicit path; forward and gradients agree.
    pad_mask = mask.clone().expand(2, 1, 8, 8).clone()
    pad_mask[1, :, 3, :] = True
    # reset_attention_mask style: two documents per sample, per-sample masks
    doc_mask = mask.expand(2, 1, 8, 8).clone()
    doc_mask[:, :, 4:, :4] = True
    results = []
    for allow in (True, False):
        _set_sdpa(model, allow)
        model.zero_grad()
        loss = model(ids, pos, mask, labels=labels)
        loss.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        padded = model(ids, pos, pad_mask)
        (padded * torch.linspace(-1, 1, padded.numel()).view_as(padded)).sum().backward()
        grads += [p.grad.clone() for p in model.parameters()]
        docs = model(ids, pos, doc_mask)
        results.append((loss.detach(), grads, padded.detach(), docs.detach()))
    torch.testing.assert_close(results[0][3], results[1][3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch.isfinite(results[0][2]).all()
    torch.testing.assert_close(results[0][2], results[1][2], rtol=1e-5, atol=1e-5)


def _loss_and_grads(config, ids, pos, mask, labels):
    model = build_gpt(config, seed=11).train()
    model_parallel_manual_seed(99, 0)
    loss = model(ids, pos, mask, labels=labels)
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="selective"),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    ],
)
def test_recompute_matches_no_recompute_with_dropout(recompute):
    ids, pos, mask, labels = batch(batch_size=2)
    base = dict(num_layers=3, hidden_dropout=0.2, attention_dropout=0.2)
    ref_loss, ref_grads = _loss_and_grads(tiny_config(**base), ids, pos, mask, labels)
    loss, grads = _loss_and_grads(tiny_config(**base, **recompute), ids, pos, mask, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    # dropout is really on: a different seed changes the loss
    other = build_gpt(tiny_config(**base), seed=11).train()
    model_parallel_manual_seed(100, 0)
    assert not torch.allclose(other(ids, pos, mask, labels=labels), ref_loss)


def test_dropout_rng_streams_are_reproducible():
    config = tiny_config(hidden_dropout=0.3, attention_dropout=0.3)
    ids, pos, mask, labels = batch()
    model = build_gpt(config).train()
    model_parallel_manual_seed(5, 0)
    a = model(ids, pos, mask, labels=labels)
    model_parallel_manual_seed(5, 0)
    b = model(ids, pos, mask, labels=labels)
    assert torch.equal(a, b)
    model.eval()
    c = model(ids, pos, mask, labels=labels)
    assert not torch.allclose(a, c)


def test_kv_cache_decoding_matches_full_forward():
    model = build_gpt(tiny_config()).eval()
    ids, pos, mask, _ = batch()
    full = model(ids, pos, mask)
    params = InferenceParams(max_batch_size=2, max_sequence_length=8)
    with torch.no_grad():
        first = model(ids[:, :5], pos[:, :5], mask[..., :5, :5], inference_params=params)
        outs = [first]
        params.sequence_len_offset = 5
        for t in range(5, 8):
            # full mask given: the attention slices rows [t, t+1) and columns [0, t+1)
            outs.append(model(ids[:, t : t + 1], pos[:, t : t + 1], mask, inference_params=params))
            params.sequence_len_offset += 1
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [dict(openai_gelu=True), dict(apply_residual_connection_post_layernorm=True), dict(fp32_residual_connection=True),
     dict(share_embeddings_and_output_weights=False)],
)
def test_variants_run_and_train(overrides):
    model = build_gpt(tiny_config(**overrides))
    ids, pos, mask, labels = batch()
    loss = model(ids, pos, mask, labels=labels)
    assert torch.isfinite(loss).all()
    loss.mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    if not model.share_embeddings_and_output_weights:
        ckpt = model.state_dict_for_save_checkpoint()
        assert list(ckpt["language_model"]["output_layer"]) == ["weight"]


def test_bad_config_errors_are_clear():
    with pytest.raises(ValueError, match="padded_vocab_size"):
        GPTModel(tiny_config(padded_vocab_size=0))
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        GPTModel(tiny_config(tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match="recompute-method"):
        ParallelTransformer(tiny_config(recompute_granularity="full"))
    model = build_gpt(tiny_config(max_position_embeddings=8))
    ids, pos, mask, _ = batch()
    with pytest.raises(ValueError, match="max-position-embeddings"):
        model(ids, pos + 1, mask)


def test_pipeline_layer_offsets_match_megatron():
    from megatron.core.parallel_state import ParallelState
    from megatron.layers.transformer import layers_on_this_stage

    config = tiny_config(num_layers=8)
    # plain pipeline: 4 stages of 2 layers
    assert [layers_on_this_stage(config, ParallelState(pp_rank=r, pp_size=4)) for r in range(4)] == [
        (2, 0), (2, 2), (2, 4), (2, 6)
    ]
    # interleaved: 2 stages x 2 chunks of 2 layers; chunk v of stage r holds layers [v*4 + r*2, +2)
    got = {
        (r, v): layers_on_this_stage(config, ParallelState(pp_rank=r, pp_size=2, virtual_pp_rank=v, virtual_pp_size=2))
        for r in range(2)
        for v in range(2)
    }
    assert got == {(0, 0): (2, 0), (1, 0): (2, 2), (0, 1): (2, 4), (1, 1): (2, 6)}
    with pytest.raises(ValueError, match="pipeline-model-parallel-size"):
        layers_on_this_stage(tiny_config(num_layers=3), ParallelState(pp_size=2))
    # layer numbers (1-based, global) reach the attention (query-key layer scaling uses them)
    stack = ParallelTransformer(config, pp_state=ParallelState(pp_rank=1, pp_size=4), post_process=False)
    assert [layer.layer_number for layer in stack.layers] == [3, 4]
    assert [layer.self_attention.core_attention.layer_number for layer in stack.layers] == [3, 4]
    assert not hasattr(stack, "final_layernorm")


def test_float16_module_wraps_gpt():
    from megatron.layers import Float16Module, unwrap_model

    inner = build_gpt(tiny_config())
    model = Float16Module(inner, torch.bfloat16)
    assert unwrap_model(model) is inner
    assert all(p.dtype == torch.bfloat16 for p in inner.parameters())
    ids, pos, mask, labels = batch()
    logits = model(ids, pos, mask)
    assert logits.dtype == torch.float32 and logits.shape == (2, 8, VOCAB)
    loss = model(ids, pos, mask, labels=labels)
    loss.mean().backward()
    assert inner.language_model.embedding.word_embeddings.weight.grad.dtype == torch.bfloat16
    assert list(model.state_dict()) == list(inner.state_dict())
    assert "language_model" in model.state_dict_for_save_checkpoint()
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        Float16Module(build_gpt(tiny_config()), torch.float32)


def test_tp_shard_rules_match_layer_attributes_and_round_trip():
    from megatron.layers.tp_shards import (
        merge_tensor_parallel_state_dicts,
        split_tensor_parallel_state_dict,
        tensor_parallel_dim,
    )

    model = build_gpt(tiny_config(share_embeddings_and_output_weights=False))
    for name, p in model.named_parameters():
        expected = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        assert tensor_parallel_dim(name) == expected, name
    sd = model.state_dict()
    shards = split_tensor_parallel_state_dict(sd, 4)
    assert shards[1]["language_model.encoder.layers.0.self_attention.query_key_value.weight"].shape == (24, 32)
    merged = merge_tensor_parallel_state_dicts(shards)
    assert all(torch.equal(merged[k], v) for k, v in sd.items())
    with pytest.raises(ValueError, match="not divisible"):
        split_tensor_parallel_state_dict(sd, 3)


def test_legacy_checkpoint_names_load():
    model = build_gpt(tiny_config(), seed=1)
    lm = model.state_dict_for_save_checkpoint()["language_model"]
    legacy = {"embedding": lm["embedding"],
              "transformer": {k.replace("self_attention.", "attention."): v for k, v in lm["encoder"].items()}}
    other = build_gpt(tiny_config(), seed=2)
    other.load_state_dict({"language_model": legacy})
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))


def test_mask_none_means_causal():
    model = build_gpt(tiny_config()).eval()
    ids, pos, mask, _ = batch()
    torch.testing.assert_close(model(ids, pos, None), model(ids, pos, mask), rtol=1e-5, atol=1e-5)
    _set_sdpa(model, False)
    torch.testing.assert_close(model(ids, pos, None), model(ids, pos, mask), rtol=1e-5, atol=1e-5)


def test_mask_classification_is_cached_per_mask_object():
    from megatron.layers.attention import _classify_mask

    causal = torch.ones(1, 1, 4, 4, dtype=torch.bool).triu(1)
    assert _classify_mask(causal, 4, 4) == (False, True)
    causal[0, 0, 2, :] = True  # in-place change bumps the version counter: re-evaluated
    assert _classify_mask(causal, 4, 4) == (True, False)
    assert _classify_mask(torch.zeros(2, 1, 4, 4, dtype=torch.bool), 4, 4) == (False, False)
