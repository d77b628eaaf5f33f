"""Parameter-owned tensor-parallel layouts for the Llama-family variants (GQA fused QKV, SwiGLU [gate; up] per rank,
untied output layer, qkv bias): TP=1 -> TP=2/4 -> TP=1 is bitwise, and a TP=2 (+SP) model equals TP=1 (2 gloo
processes): weights at initialisation, logits, per-token loss, gradients and KV-cache generation."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.core.tensor_parallel import get_tp_layout
from megatron.layers.tp_shards import (
    merge_tensor_parallel_state_dicts,
    split_tensor_parallel_state_dict,
    tensor_parallel_layouts,
)
from tests.dist_utils import run_distributed
from tests.model.helpers import batch, build_gpt, reference_pass, tiny_config

SEED = 4321
TOL = dict(rtol=1e-5, atol=1e-5)
QKV = "language_model.encoder.layers.0.self_attention.query_key_value.weight"
FC1 = "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"


def llama_config(**overrides):
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
              ffn_hidden_size=24, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
              add_bias_linear=False, add_qkv_bias=True, share_embeddings_and_output_weights=False,
              init_method_std=0.1)
    kw.update(overrides)
    return tiny_config(**kw)


@pytest.mark.parametrize("how", ["model", "config", "names_and_shapes"])
@pytest.mark.parametrize("tp", [2, 4])
def test_split_merge_is_bitwise(tp, how):
    mha = dict(group_query_attention=False, num_query_groups=None) if how == "names_and_shapes" else {}
    config = llama_config(**mha)  # from names and shapes alone: SwiGLU yes, GQA refused (see below)
    model = build_gpt(config, seed=SEED)
    sd = model.state_dict()
    kw = {"model": dict(layouts=tensor_parallel_layouts(model)), "config": dict(config=config),
          "names_and_shapes": {}}[how]
    shards = split_tensor_parallel_state_dict(sd, tp, **kw)
    # SwiGLU: rank r holds [gate_r; up_r]; GQA: rank r holds whole KV groups [q x 2; k; v]
    gate, up = sd[FC1].chunk(2)
    for r, shard in enumerate(shards):
        assert torch.equal(shard[FC1], torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
        assert torch.equal(shard[QKV], sd[QKV].chunk(tp)[r])
    merged = merge_tensor_parallel_state_dicts(shards, **kw)
    assert list(merged) == list(sd)
    assert all(torch.equal(merged[k], v) for k, v in sd.items())
    # and via an intermediate TP: 1 -> tp -> 1 -> 2 -> 1
    again = merge_tensor_parallel_state_dicts(split_tensor_parallel_state_dict(merged, 2, **kw), **kw)
    assert all(torch.equal(again[k], v) for k, v in sd.items())


def test_layouts_are_owned_by_the_parameters():
    model = build_gpt(llama_config(), seed=SEED)
    params = dict(model.named_parameters())
    assert get_tp_layout(params[FC1]).blocks == 2
    assert get_tp_layout(params[QKV]).unit == (2 + 2) * 4  # 2 queries per group + k + v, head dim 4
    assert get_tp_layout(params["language_model.output_layer.weight"]).dim == 0
    assert get_tp_layout(params["language_model.encoder.layers.0.mlp.dense_4h_to_h.weight"]).dim == 1
    assert get_tp_layout(params["language_model.encoder.final_layernorm.weight"]).replicated
    assert "language_model.embedding.position_embeddings.weight" not in params  # RoPE: no position table


def test_split_refuses_to_cut_a_kv_group():
    config = llama_config(num_query_groups=2)
    sd = build_gpt(config, seed=SEED).state_dict()
    with pytest.raises(ValueError, match="query_key_value.*tensor parallel size 4"):
        split_tensor_parallel_state_dict(sd, 4, config=config)
    with pytest.raises(ValueError, match="grouped-query.*pass config="):  # no layouts: never a silent bad split
        split_tensor_parallel_state_dict(sd, 2)


def _gather(t: torch.Tensor, layout, group) -> torch.Tensor:
    if layout.replicated:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return layout.merge(parts)


PROMPTS = [[5, 17, 33], [9, 2, 60, 40, 3, 58, 12]]


def _generate(model) -> list:
    from megatron.text_generation import generate

    out = generate(model, None, PROMPTS, 6, greedy=True, eod_id=63, use_eod_token_for_early_termination=False,
                   return_output_log_probs=True)
    return [out["tokens"], out["logprobs"]]


def _tp2_worker(rank: int, world_size: int, ref_state, ref_logits, ref_loss, ref_grads, ref_generated) -> list:
    done = []
    for sp in (False, True):
        state = initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            config = llama_config(tensor_model_parallel_size=2, sequence_parallel=sp)
            model = build_gpt(config, seed=SEED, tp_rank=state.tp_rank, pp_state=state)
            expected = split_tensor_parallel_state_dict(ref_state, 2, config=config)[state.tp_rank]
            for name, value in model.state_dict().items():  # CPU init follows the layouts: TP=2 == TP=1
                assert torch.equal(value, expected[name]), name
            ids, pos, mask, labels = batch()
            model.parallel_output = False
            torch.testing.assert_close(model(ids, pos, mask), ref_logits, **TOL)
            model.parallel_output = True
            loss = model(ids, pos, mask, labels=labels)
            torch.testing.assert_close(loss, ref_loss, **TOL)
            loss.mean().backward()
            for name, p in model.named_parameters():
                g = p.grad.clone()
                if sp and getattr(p, "sequence_parallel", False):
                    dist.all_reduce(g, group=state.tp_group)
                torch.testing.assert_close(_gather(g, get_tp_layout(p), state.tp_group), ref_grads[name], **TOL,
                                           msg=name)
            if not sp:  # generation under TP: the KV cache holds this rank's query groups
                tokens, logprobs = _generate(model.eval())
                assert tokens == ref_generated[0]
                for a, b in zip(logprobs, ref_generated[1]):
                    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **TOL)
            done.append(sp)
        finally:
            destroy_model_parallel()
    return done


def test_tp2_and_sp_equal_tp1():
    ref = build_gpt(llama_config(), seed=SEED)
    logits, loss, grads = reference_pass(ref, batch())
    generated = _generate(build_gpt(llama_config(), seed=SEED).eval())
    results = run_distributed(_tp2_worker, 2, args=(ref.state_dict(), logits, loss, grads, generated))
    assert results == [[False, True], [False, True]]
