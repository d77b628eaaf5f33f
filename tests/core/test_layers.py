"""Tensor-parallel layers on 2 and 4 gloo ranks equal the serial (TP=1) computation: weights, outputs, grads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.transformer_config import ModelParallelConfig
from tests.dist_utils import run_distributed


def _init(w):
    return torch.nn.init.normal_(w, mean=0.0, std=0.5)


def _pair(cls, seed, *args, group, cfg=None, **kwargs):
    """The serial layer and this rank's TP shard of it, both built from the same torch seed."""
    cfg = cfg or ModelParallelConfig()
    torch.manual_seed(seed)
    serial = cls(*args, config=cfg, init_method=_init, tp_group=None, **kwargs)
    torch.manual_seed(seed)
    parallel = cls(*args, config=cfg, init_method=_init, tp_group=group, **kwargs)
    return serial, parallel


def _err(a, b):
    return float((a - b).abs().max()) if a.shape == b.shape else float("inf")


def _layers_body(rank, world):  # noqa: PLR0915 - one process launch checks every layer
    group = ps.initialize_model_parallel(world, 1).tp_group
    last = lambda t: torch.chunk(t, world, dim=-1)[rank]  # noqa: E731
    first = lambda t: torch.chunk(t, world, dim=0)[rank]  # noqa: E731
    s, b, h, o = 2 * world, 3, 4 * world, 6 * world
    torch.manual_seed(7)
    X = torch.randn(s, b, h)
    G = torch.randn(s, b, o)
    Gh = torch.randn(s, b, h)
    bias_o = torch.randn(o)
    bias_h = torch.randn(h)
    errs = {}

    # Column-parallel linear: output kept split / gathered; dX all-reduce via copy_to or the async path.
    for gather, use_async in ((False, False), (True, False), (False, True)):
        cfg = ModelParallelConfig(async_tensor_model_parallel_allreduce=use_async)
        ser, par = _pair(tp.ColumnParallelLinear, 1, h, o, group=group, cfg=cfg, gather_output=gather)
        tag = f"col{gather}{use_async}"
        errs[f"{tag}_init"] = _err(par.weight, first(ser.weight)) + (0.0 if par.weight.tensor_model_parallel else 1)
        with torch.no_grad():
            ser.bias.copy_(bias_o)
            par.bias.copy_(first(bias_o))
        xs, xp = X.clone().requires_grad_(), X.clone().requires_grad_()
        ys, bs = ser(xs)
        yp, bp = par(xp)
        (ys * G).sum().backward()
        (yp * (G if gather else last(G))).sum().backward()
        errs[f"{tag}_fwd"] = _err(yp, ys if gather else last(ys))
        errs[f"{tag}_dx"] = _err(xp.grad, xs.grad)
        errs[f"{tag}_dw"] = _err(par.weight.grad, first(ser.weight.grad))
        errs[f"{tag}_db"] = _err(par.bias.grad, first(ser.bias.grad))
        errs[f"{tag}_nobias"] = float(bs is not None or bp is not None)

    # Row-parallel linear, input already split or scattered here.
    for is_parallel in (True, False):
        ser, par = _pair(tp.RowParallelLinear, 2, o, h, group=group, input_is_parallel=is_parallel)
        errs[f"row{is_parallel}_init"] = _err(par.weight, last(ser.weight))
        with torch.no_grad():
            ser.bias.copy_(bias_h)
            par.bias.copy_(bias_h)
        Xo = torch.randn(s, b, o, generator=torch.Generator().manual_seed(3))
        xs = Xo.clone().requires_grad_()
        xp = (last(Xo) if is_parallel else Xo).clone().requires_grad_()
        ys, _ = ser(xs)
        yp, _ = par(xp)
        (ys * Gh).sum().backward()
        (yp * Gh).sum().backward()
        errs[f"row{is_parallel}_fwd"] = _err(yp, ys)
        errs[f"row{is_parallel}_dx"] = _err(xp.grad, last(xs.grad) if is_parallel else xs.grad)
        errs[f"row{is_parallel}_dw"] = _err(par.weight.grad, last(ser.weight.grad))
        errs[f"row{is_parallel}_db"] = _err(par.bias.grad, ser.bias.grad)

    # Sequence parallel: column all-gathers a sequence-split input, row reduce-scatters its output.
    ser_c, par_c = _pair(tp.ColumnParallelLinear, 3, h, o, group=group, sequence_parallel=True)
    ser_r, par_r = _pair(tp.RowParallelLinear, 4, o, h, group=group, sequence_parallel=True)
    with torch.no_grad():
        ser_r.bias.copy_(bias_h)
        par_r.bias.copy_(bias_h)
    xs, xp = X.clone().requires_grad_(), first(X).clone().requires_grad_()
    ys = ser_r(F.gelu(ser_c(xs)[0]))[0]
    yp = par_r(F.gelu(par_c(xp)[0]))[0]
    (ys * Gh).sum().backward()
    (yp * first(Gh)).sum().backward()
    errs["sp_fwd"] = _err(yp, first(ys))
    errs["sp_dx"] = _err(xp.grad, first(xs.grad))
    errs["sp_col_dw"] = _err(par_c.weight.grad, first(ser_c.weight.grad))
    errs["sp_row_dw"] = _err(par_r.weight.grad, last(ser_r.weight.grad))
    db = par_r.bias.grad.clone()
    torch.distributed.all_reduce(db, group=group)  # SP bias grads are partial: the optimizer side sums them
    errs["sp_row_db"] = _err(db, ser_r.bias.grad) + (0.0 if par_r.bias.sequence_parallel else 1)

    # skip_bias_add hands the bias back instead of adding it.
    _, par = _pair(tp.ColumnParallelLinear, 5, h, o, group=group, skip_bias_add=True)
    y, bias = par(X)
    errs["skip_bias"] = float(bias is not par.bias)

    # Vocab-parallel embedding.
    V = 8 * world
    ser, par = _pair(tp.VocabParallelEmbedding, 6, V, h, group=group)
    errs["emb_init"] = _err(par.weight, first(ser.weight))
    ids = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(4))
    ys, yp = ser(ids), par(ids)
    G2 = torch.randn(b, s, h, generator=torch.Generator().manual_seed(5))
    (ys * G2).sum().backward()
    (yp * G2).sum().backward()
    errs["emb_fwd"] = _err(yp, ys)
    errs["emb_dw"] = _err(par.weight.grad, first(ser.weight.grad))

    # Strided init (Megatron's stride > 1): shard r holds pieces r, r+world, ... of size out/(world*stride).
    ser, par = _pair(tp.ColumnParallelLinear, 7, h, o, group=group, stride=2)
    pieces = torch.split(ser.weight, o // (world * 2), dim=0)
    errs["stride_init"] = _err(par.weight, torch.cat(pieces[rank::world], dim=0))

    ps.destroy_model_parallel()
    return errs


def _chain(emb, col, row, out, ids, labels, group, sp, smoothing):
    """GPT-like chain: embed → [s,b,h] → col → gelu → row → tied output layer → vocab-parallel CE → mean."""
    h = emb(ids).transpose(0, 1).contiguous()
    if sp:
        h = tp.scatter_to_sequence_parallel_region(h, group)
    x = row(F.gelu(col(h)[0]))[0] + h
    logits = out(x, weight=emb.weight)[0]
    return tp.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels, group, smoothing).mean()


def _chain_body(rank, world, sp, smoothing):
    group = ps.initialize_model_parallel(world, 1).tp_group
    first = lambda t: torch.chunk(t, world, dim=0)[rank]  # noqa: E731
    last = lambda t: torch.chunk(t, world, dim=-1)[rank]  # noqa: E731
    V, h, s, b = 16 * world, 8 * world, 4 * world, 2
    ids = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(11))
    labels = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(12))
    results = []
    for grp, seq_par in ((None, False), (group, sp)):
        torch.manual_seed(123)
        cfg = ModelParallelConfig(sequence_parallel=seq_par)
        emb = tp.VocabParallelEmbedding(V, h, init_method=_init, config=cfg, tp_group=grp)
        col = tp.ColumnParallelLinear(h, 4 * h, config=cfg, init_method=_init, tp_group=grp)
        row = tp.RowParallelLinear(4 * h, h, config=cfg, init_method=_init, tp_group=grp)
        out = tp.ColumnParallelLinear(h, V, config=cfg, init_method=_init, tp_group=grp, bias=False,
                                      skip_weight_param_allocation=True)
        loss = _chain(emb, col, row, out, ids, labels, grp, seq_par, smoothing)
        loss.backward()
        results.append((loss.detach(), emb, col, row))
    (l_ser, e_ser, c_ser, r_ser), (l_par, e_par, c_par, r_par) = results
    rb = r_par.bias.grad.clone()
    if sp:
        torch.distributed.all_reduce(rb, group=group)
    errs = {
        "loss": _err(l_par, l_ser),
        "emb_dw": _err(e_par.weight.grad, first(e_ser.weight.grad)),
        "col_dw": _err(c_par.weight.grad, first(c_ser.weight.grad)),
        "col_db": _err(c_par.bias.grad, first(c_ser.bias.grad)),
        "row_dw": _err(r_par.weight.grad, last(r_ser.weight.grad)),
        "row_db": _err(rb, r_ser.bias.grad),
    }
    ps.destroy_model_parallel()
    return {"errs": errs, "loss": float(l_ser)}


def _all_body(rank, world, chains):
    """One process launch per world size: every layer check, then the chain for each (sp, smoothing)."""
    return {"layers": _layers_body(rank, world), "chains": [_chain_body(rank, world, *c) for c in chains]}


CHAINS = {2: [(False, 0.0), (True, 0.1)], 4: [(True, 0.0), (False, 0.2)]}


@pytest.mark.parametrize("world", [2, 4])
def test_layers_and_chain_match_serial(world):
    results = run_distributed(_all_body, world, args=(CHAINS[world],))
    for rank, res in enumerate(results):
        errs = res["layers"]
        bad = {k: v for k, v in errs.items() if not v < 1e-4}
        assert not bad, (rank, bad)
        for key, value in errs.items():
            if key.endswith("_init"):  # same seed: shards are bitwise slices of the serial weight
                assert value == 0.0, (rank, key)
        for (sp, smoothing), chain in zip(CHAINS[world], res["chains"]):
            assert chain["loss"] > 1.0  # a real loss, not zero
            bad = {k: v for k, v in chain["errs"].items() if not v < 2e-5}
            assert not bad, (rank, sp, smoothing, bad)


def test_layer_errors_are_clear():
    cfg = ModelParallelConfig()
    layer = tp.ColumnParallelLinear(4, 6, config=cfg, init_method=_init, skip_weight_param_allocation=True)
    with pytest.raises(RuntimeError, match="pass weight="):
        layer(torch.randn(2, 4))
    with pytest.raises(ValueError, match="expected"):
        layer(torch.randn(2, 4), weight=torch.randn(5, 4))
    emb = tp.VocabParallelEmbedding(10, 4, init_method=_init, config=cfg)
    with pytest.raises(ValueError, match="out of range"):
        emb(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="divisible"):
        tp.VocabUtility.vocab_range_from_global_vocab_size(10, 0, 4)
    assert layer.weight is None and emb.weight.partition_dim == 0


def test_parameter_attribute_helpers():
    p = torch.nn.Parameter(torch.zeros(2))
    tp.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (False, -1, 1)
    assert tp.param_is_not_tensor_parallel_duplicate(p, 0) and not tp.param_is_not_tensor_parallel_duplicate(p, 1)
    q = torch.nn.Parameter(torch.zeros(2))
    tp.set_tensor_model_parallel_attributes(q, True, 1, 3)
    r = torch.nn.Parameter(torch.zeros(2))
    tp.copy_tensor_model_parallel_attributes(r, q)
    assert (r.tensor_model_parallel, r.partition_dim, r.partition_stride) == (True, 1, 3)
    assert tp.param_is_not_tensor_parallel_duplicate(r, 1)
