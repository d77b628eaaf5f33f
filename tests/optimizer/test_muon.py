"""--optimizer muon: parameters after 5 steps of a tiny Llama equal megatron-core 0.16.1's Muon (recorded by
tests/fixtures/muon_oracle/generate_mcore_muon.py, since its dependency emerging-optimizers is not installable here)
within 1e-6, QKV split included; and equal torch.optim.Muon + torch.optim.AdamW on the same parameter split where the
definitions agree; the parameter split, the one-line refusals, and the state in a state dict round trip."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from megatron.arguments import parse_args, validate_args
from megatron.checkpoint.conversion.optimizer_state import regular_entries
from megatron.checkpoint.conversion.torch_dist_optim import incomplete_names
from megatron.errors import MegatronUserError
from megatron.layers.mcore_names import core_to_ours, ours_to_core
from megatron.learning_rates import OptimizerParamScheduler
from megatron.optimizer import MuonWithAdamW, OptimizerConfig, get_megatron_optimizer
from megatron.optimizer.distrib_optimizer import (
    PARAM_STATE_FORMAT,
    param_state_to_regular_state,
    regular_state_to_param_state,
)
from megatron.optimizer.muon import newton_schulz
from tests.model.helpers import build_gpt, tiny_config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "muon_oracle" / "mcore_muon_llama.pt"
STEPS, LR, WD = 5, 0.02, 0.1  # as the generator
CASES = {
    "default": dict(muon_momentum=0.9, muon_use_nesterov=False, muon_scale_mode="spectral",
                    muon_fp32_matmul_prec="medium", muon_split_qkv=True, muon_extra_scale_factor=1.0),
    "nesterov_fp32_noqkvsplit": dict(muon_momentum=0.95, muon_use_nesterov=True, muon_scale_mode="shape_scaling",
                                     muon_fp32_matmul_prec="high", muon_split_qkv=False,
                                     muon_extra_scale_factor=0.5),
    "unit_rms_fp32_split": dict(muon_momentum=0.9, muon_use_nesterov=False, muon_scale_mode="unit_rms_norm",
                                muon_fp32_matmul_prec="high", muon_split_qkv=True, muon_extra_scale_factor=1.0),
}


def seeded_tensors(shapes: dict, seed: int, scale: float) -> dict:
    """The generator's: {name: scale * randn(shape)} in sorted-name order from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(shapes[n], generator=g) for n in sorted(shapes)}


def _llama():
    cfg = tiny_config(num_query_groups=2, group_query_attention=True, normalization="RMSNorm", swiglu=True,
                      position_embedding_type="rope", add_bias_linear=False, ffn_hidden_size=64,
                      share_embeddings_and_output_weights=False)
    model = build_gpt(cfg)
    params = dict(model.named_parameters())
    shapes = {n: p.shape for n, p in ours_to_core(params).items()}
    init = {n: t + (1.0 if "layernorm" in n else 0.0) for n, t in seeded_tensors(shapes, 0, 0.2).items()}
    with torch.no_grad():
        for n, t in core_to_ours(init).items():
            params[n].copy_(t)
    return model, shapes


def _run(model, shapes: dict, optimizer) -> None:
    params = dict(model.named_parameters())
    OptimizerParamScheduler(optimizer, LR, LR, LR, 0, 100, "constant", WD, WD, 100, "constant")
    for step in range(STEPS):
        for n, g in core_to_ours(seeded_tensors(shapes, 100 + step, 0.1)).items():
            params[n].grad = g.clone()
        optimizer.step()


@pytest.fixture(scope="module")
def recorded() -> dict:
    return torch.load(FIXTURE)


@pytest.mark.parametrize("case", sorted(CASES))
def test_muon_equals_megatron_core(case, recorded) -> None:
    model, shapes = _llama()
    config = OptimizerConfig(optimizer="muon", lr=LR, min_lr=LR, weight_decay=WD, clip_grad=0.0, **CASES[case])
    _run(model, shapes, get_megatron_optimizer(model, config))
    ours = ours_to_core({n: p.detach() for n, p in model.named_parameters()})
    before = _llama()[0]
    moved = 0.0
    for name, expected in recorded[case].items():
        assert (ours[name] - expected).abs().max().item() <= 1e-6, (case, name)
        moved = max(moved, (expected - ours_to_core(dict(before.named_parameters()))[name]).abs().max().item())
    assert moved > 1e-2  # the steps did move the weights


def test_qkv_split_changes_the_update(recorded) -> None:
    """The recorded split and unsplit runs differ on the QKV weights only where the split matters."""
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.allclose(recorded["default"][name], recorded["nesterov_fp32_noqkvsplit"][name], atol=1e-3)


def test_equals_torch_muon_and_adamw_on_the_same_split() -> None:
    """torch.optim.Muon (its constant "simple" coefficients, bf16 iteration, shape-scaled lr, no QKV split) on our
    Muon parameters plus torch.optim.AdamW on the rest, against ours with the same definitions: --muon-scale-mode
    shape_scaling, --muon-no-split-qkv, bf16 Newton-Schulz, and the coefficient set switched to "simple". What still
    differs: torch normalises the matrix after casting it to bf16, Megatron before (in fp32), so Muon weights agree to
    the bf16 rounding of the updates (within 3% of the distance moved; 0.02 after 5 steps), AdamW weights to 1e-6."""
    model, shapes = _llama()
    twin = copy.deepcopy(model)
    config = OptimizerConfig(optimizer="muon", lr=LR, min_lr=LR, weight_decay=WD, clip_grad=0.0, muon_momentum=0.95,
                             muon_use_nesterov=True, muon_scale_mode="shape_scaling", muon_split_qkv=False)
    ours = get_megatron_optimizer(model, config)
    inner: MuonWithAdamW = ours.optimizer
    inner.coefficient_type = "simple"
    _run(model, shapes, ours)

    names = dict(twin.named_parameters())
    muon_names = {n for n, p in names.items() if p.dim() == 2 and not n.endswith("word_embeddings.weight")
                  and not n.endswith("output_layer.weight")}
    assert {id(p) for g in inner.param_groups if g["muon"] for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if n in muon_names}
    torch_muon = torch.optim.Muon([names[n] for n in sorted(muon_names)], lr=LR, weight_decay=WD, momentum=0.95,
                                  nesterov=True, adjust_lr_fn="original")
    decay = [p for n, p in names.items() if n not in muon_names and p.dim() > 1]
    no_decay = [p for n, p in names.items() if n not in muon_names and p.dim() == 1]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=LR)
    for step in range(STEPS):
        for n, g in core_to_ours(seeded_tensors(shapes, 100 + step, 0.1)).items():
            names[n].grad = g.clone()
        torch_muon.step()
        adamw.step()
    start = dict(_llama()[0].named_parameters())
    for n, p in model.named_parameters():
        diff = (p - names[n]).abs().max().item()
        if n in muon_names:  # bf16 rounding of each step's update: a few percent of how far the weights moved
            assert diff <= 3e-2 * (p - start[n]).abs().max().item(), (n, diff)
        else:
            assert diff <= 1e-6, (n, diff)


def test_newton_schulz_orthogonalises() -> None:
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.set_float32_matmul_precision("highest")
        o = newton_schulz(g, 5)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.25  # the quintic schedule's band around 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer="muon", use_distributed_optimizer=True), "does not work with --use-distributed-optimizer"),
    (dict(optimizer="dist_muon", use_distributed_optimizer=True), "use --optimizer dist_muon"),
])
def test_refusals(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kwargs)


def test_bad_muon_values_refused() -> None:
    model, _ = _llama()
    for kwargs, match in ((dict(muon_fp32_matmul_prec="low"), "no such float32 matmul precision"),
                          (dict(muon_num_ns_steps=3), "must be a multiple of 5")):
        opt = get_megatron_optimizer(model, OptimizerConfig(optimizer="muon", **kwargs)) \
            if "muon_num_ns_steps" in kwargs else None
        if opt is None:
            with pytest.raises(ValueError, match=match):
                get_megatron_optimizer(model, OptimizerConfig(optimizer="muon", **kwargs))
            continue
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        with pytest.raises(ValueError, match=match):
            opt.step()


def test_state_dict_round_trip_continues_exactly() -> None:
    model, shapes = _llama()
    twin = copy.deepcopy(model)
    config = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=1.0)
    opt = get_megatron_optimizer(model, config)
    _run(model, shapes, opt)
    state = opt.state_dict()
    kinds = {frozenset(s) for s in state["state"].values()}
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"exp_avg", "exp_avg_sq", "step"})}
    twin.load_state_dict(model.state_dict())
    opt2 = get_megatron_optimizer(twin, config)
    opt2.load_state_dict(copy.deepcopy(state))
    for m, o in ((model, opt), (twin, opt2)):
        params = dict(m.named_parameters())
        for n, g in core_to_ours(seeded_tensors(shapes, 7, 0.1)).items():
            params[n].grad = g.clone()
        o.step()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("extra, match", [
    (("--use-distributed-optimizer",), "does not work with --use-distributed-optimizer"),
    (("--muon-fp32-matmul-prec", "low"), "no such float32 matmul precision"),
    (("--muon-num-ns-steps", "4"), "must be a multiple of 5"),
])
def test_flags_refused_at_start_up(extra, match) -> None:
    with pytest.raises(MegatronUserError, match=match):
        validate_args(parse_args(None, False, [
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--optimizer", "muon", *extra]), {})


def test_convert_reads_muon_state_by_name_and_the_regular_optimizer_loads_it_back() -> None:
    """convert.py's reading (regular_entries) names a Muon state's entries in Muon's group order (momentum for the
    matrices, Adam's moments for the rest); the per-parameter state it writes loads into --optimizer muon
    (param_state_to_regular_state) and continues exactly. The distributed optimizer refuses Muon state in one line."""
    model, shapes = _llama()
    twin = copy.deepcopy(model)
    config = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WD)
    opt = get_megatron_optimizer(model, config)
    _run(model, shapes, opt)
    sd = opt.state_dict()
    flat = {n: p.detach() for n, p in model.named_parameters()}
    (entries,), step, keys = regular_entries(copy.deepcopy(sd), [flat], list(flat), "rank file")
    assert step == STEPS and keys == ["exp_avg", "exp_avg_sq", "momentum_buffer"]
    by_param = {p: opt.state[p] for p in model.parameters()}
    for name, p in model.named_parameters():
        want = by_param[p]
        assert set(entries[name]) == {"param"} | {k for k in want if k != "step"}, name
        for k in entries[name]:
            assert torch.equal(entries[name][k], p.detach() if k == "param" else want[k]), (name, k)
    twin.load_state_dict(model.state_dict())
    opt2 = get_megatron_optimizer(twin, config)
    body = {"format": PARAM_STATE_FORMAT, "step": step, "state_keys": keys, "chunks": [entries]}
    opt2.load_state_dict(param_state_to_regular_state(body, {}, [twin], opt2))
    for m, o in ((model, opt), (twin, opt2)):
        params = dict(m.named_parameters())
        for n, g in core_to_ours(seeded_tensors(shapes, 7, 0.1)).items():
            params[n].grad = g.clone()
        o.step()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="distributed optimizer does not take"):
        regular_state_to_param_state(sd, [model])


def test_torch_dist_state_completeness_takes_muons_momentum_or_adams_moments() -> None:
    """A torch_dist folder's optimizer state is complete per tensor: Adam's (as before) has the fp32 param of every
    tensor with state; with Muon's momentum_buffer, the momentum (Muon's matrices) or all the moments (the rest),
    never a mix or a part."""
    t = torch.zeros(1)
    adam = {"param": {"a": t}, "exp_avg": {"a": t, "b": t}, "exp_avg_sq": {"a": t}}
    assert incomplete_names(adam) == ["b"]
    muon = {"param": {"w": t, "n": t, "x": t, "y": t}, "momentum_buffer": {"w": t, "x": t},
            "exp_avg": {"n": t, "x": t, "y": t}, "exp_avg_sq": {"n": t, "x": t}}
    assert incomplete_names(muon) == ["x", "y"]
