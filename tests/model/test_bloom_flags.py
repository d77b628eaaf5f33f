"""BLOOM's Megatron-DeepSpeed flags: --position-embedding-type alibi (and the absolute/rotary spellings),
--embed-layernorm, --glu-activation geglu|liglu|reglu|swiglu (x1 * act(x2) per TP rank's halves); the config fields
they set, the checkpoint architecture that records them, one-line refusals, and the ALiBi attention paths."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from megatron.arguments import ArgumentError, core_transformer_config_from_args, parse_args, validate_args
from megatron.checkpoint.args import ArchitectureMismatchError, architecture_from_args
from megatron.compat import check_architecture
from megatron.layers.mlp import ParallelMLP
from tests.model.helpers import batch, build_gpt, tiny_config

BASE = ("--num-layers 2 --hidden-size 48 --num-attention-heads 6 --seq-length 32 --micro-batch-size 2 --train-iters 4 "
        "--lr 1e-3")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _validated(extra: str) -> argparse.Namespace:
    args = parse_args(args=(BASE + " " + extra).split())
    args.world_size = 1
    return validate_args(args)


def test_bloom_flags_set_the_config_and_the_checkpoint_architecture():
    args = _validated("--position-embedding-type alibi --embed-layernorm")
    assert args.max_position_embeddings == 32  # no position table: the sequence length is the default limit
    config = core_transformer_config_from_args(args)
    assert config.position_embedding_type == "alibi" and config.embed_layernorm and config.glu_activation is None
    arch = architecture_from_args(args)
    assert arch["position_embedding_type"] == "alibi" and arch["embed_layernorm"] is True
    with pytest.raises(ArchitectureMismatchError, match="embed_layernorm=True.*--embed-layernorm"):
        check_architecture(arch, _validated("--position-embedding-type alibi"), "ckpt")
    with pytest.raises(ArchitectureMismatchError, match="position_embedding_type='alibi'"):
        check_architecture(arch, _validated("--embed-layernorm --max-position-embeddings 32"), "ckpt")


@pytest.mark.parametrize("name,ours", [("absolute", "learned_absolute"), ("rotary", "rope")])
def test_megatron_deepspeed_position_names(name, ours):
    extra = "--max-position-embeddings 32" if name == "absolute" else ""
    assert _validated(f"--position-embedding-type {name} {extra}").position_embedding_type == ours


def test_glu_activation_flag():
    args = _validated("--glu-activation geglu --max-position-embeddings 32")
    assert core_transformer_config_from_args(args).glu_activation == "geglu"
    assert args.ffn_hidden_size == 4 * 48  # Megatron-DeepSpeed keeps the 4h width (dense_h_to_4h has 2 * ffn rows)
    assert architecture_from_args(args)["glu_activation"] == "geglu"
    with pytest.raises(ArgumentError, match="--swiglu and --glu-activation are different activations; pick one"):
        _validated("--glu-activation swiglu --swiglu --max-position-embeddings 32")
    with pytest.raises(SystemExit):  # argparse's one line: not one of the four
        parse_args(args=(BASE + " --glu-activation bilinear").split())


@pytest.mark.parametrize("name,act", [("geglu", F.gelu), ("liglu", lambda x: x), ("reglu", F.relu),
                                      ("swiglu", F.silu)])
def test_glu_mlp_computes_x1_times_act_x2(name, act):
    config = tiny_config(glu_activation=name, ffn_hidden_size=40)
    torch.manual_seed(0)
    mlp = ParallelMLP(config)
    assert mlp.dense_h_to_4h.weight.shape == (80, 32)
    x = torch.randn(5, 2, 32)
    out, bias = mlp(x)
    h = x @ mlp.dense_h_to_4h.weight.t() + mlp.dense_h_to_4h.bias
    x1, x2 = h.chunk(2, dim=-1)
    ref = (x1 * act(x2)) @ mlp.dense_4h_to_h.weight.t()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_alibi_sdpa_equals_explicit_path_and_layer_scaling():
    """Forward and gradients: SDPA with the additive float mask == the explicit baddbmm-style path, also under
    --apply-query-key-layer-scaling (Megatron-DeepSpeed's beta = 1 / layer_number)."""
    ids, pos, mask, labels = batch(seq=12, vocab=64)
    results = []
    for sdpa, scaling in ((True, False), (False, False), (False, True)):
        config = tiny_config(num_attention_heads=6, hidden_size=48, position_embedding_type="alibi",
                             embed_layernorm=True, apply_query_key_layer_scaling=scaling, max_position_embeddings=16)
        model = build_gpt(config, seed=3)
        for layer in model.language_model.encoder.layers:
            layer.self_attention.core_attention.allow_sdpa = sdpa
        loss = model(ids, pos, mask, labels=labels).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert "language_model.embedding.word_embeddings.norm.weight" in results[0][1]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-6)
        for n, g in grads.items():
            torch.testing.assert_close(g, results[0][1][n], rtol=1e-4, atol=1e-6, msg=n)


def test_alibi_refused_for_bert_one_line():
    from megatron.models.bert.model import BertModel

    with pytest.raises(ValueError, match="alibi"):
        BertModel(tiny_config(position_embedding_type="alibi"))


def test_bloom_recompute_and_bf16():
    """Selective and full recomputation give the same loss and gradients as none; a bf16 BLOOM runs forward and
    backward with the bias in bf16 (as Megatron-DeepSpeed casts it) close to fp32."""
    ids, pos, mask, labels = batch(seq=12, vocab=64)
    bloom = dict(num_attention_heads=6, hidden_size=48, position_embedding_type="alibi", embed_layernorm=True,
                 max_position_embeddings=16)
    results = {}
    for name, extra in (("none", {}), ("selective", dict(recompute_granularity="selective")),
                        ("full", dict(recompute_granularity="full", recompute_method="uniform",
                                      recompute_num_layers=1))):
        model = build_gpt(tiny_config(**bloom, **extra), seed=3).train()
        loss = model(ids, pos, mask, labels=labels).mean()
        loss.backward()
        results[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    for name in ("selective", "full"):
        torch.testing.assert_close(results[name][0], results["none"][0], rtol=0, atol=0)
        for n, g in results[name][1].items():
            torch.testing.assert_close(g, results["none"][1][n], rtol=1e-6, atol=1e-7, msg=n)
    model = build_gpt(tiny_config(**bloom, bf16=True, params_dtype=torch.bfloat16), seed=3)
    loss = model(ids, pos, mask, labels=labels).float().mean()
    loss.backward()
    assert abs(float(loss.detach()) - float(results["none"][0])) < 0.05
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
