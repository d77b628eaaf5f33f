"""The aux-loss-free expert bias in training (--moe-router-enable-expert-bias with group-limited sigmoid routing):
DP=2, EP=2 (alltoall and allgather, one EP rank's experts left idle by the routing), PP=2 and DeepSpeed ZeRO-1 (DP=2) give the serial run's curve with the bias updated from the global token counts, the bias in
every rank's checkpoint equals the serial run's; resuming at iteration 4 from a legacy and from a torch_dist
checkpoint reproduces 5..8 exactly (the bias is saved under Megatron Core's name and loaded); tools/checkpoint/
convert.py carries the bias and the router flags into EP2 folders and into torch_dist."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.conversion.driver import main as convert
from megatron.checkpoint.conversion.torch_dist import read_tensors
from tests.dist_utils import run_distributed
from tests.ds._workers import write_ds_config
from tests.log_lines import iteration_values
from tests.training._llama import run_many
from tests.training._workers import tiny_gpt_argv

pytestmark = pytest.mark.slow
ITERS, HALF = 8, 4
MOE = ["--hidden-size", "32", "--seq-length", "32", "--max-position-embeddings", "32", "--ffn-hidden-size", "48",
       "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", "0.05", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
       "--moe-router-topk-scaling-factor", "2.0", "--moe-aux-loss-coeff", "0.01", "--moe-layer-freq", "[1,0]",
       "--micro-batch-size", "2", "--eval-interval", "100", "--save-interval", str(HALF)]
BIAS_KEY = "layers.0.mlp.router.expert_bias"


def _argv(data: dict, *extra: str) -> list[str]:
    return tiny_gpt_argv(data, *MOE, *extra, iters=ITERS)


def _curve(result: dict, what: str) -> dict:
    assert result["error"] is None, f"{what}: {result['error']}"
    lm, lbl = (iteration_values(result["stdout"], key) for key in ("lm loss", "load_balancing_loss"))
    return {it: (lm[it], lbl[it]) for it in lm}


def _legacy_bias(ckpt: Path, folder: str = "mp_rank_00", iteration: int = ITERS) -> torch.Tensor:
    sd = torch.load(ckpt / f"iter_{iteration:07d}" / folder / "model_optim_rng.pt", weights_only=False)
    bias = sd["model"]["language_model"]["encoder"][BIAS_KEY]
    assert bias.dtype == torch.float32 and "local_tokens_per_expert" not in str(sd["model"].keys())
    return bias


def test_expert_bias_layouts_match_serial_and_resume(gpt_data: dict, tmp_path: Path) -> None:
    ck, dist_ck = tmp_path / "ck", tmp_path / "dist"
    at_half = []
    for src in (ck, dist_ck):
        at_half.append(tmp_path / f"{src.name}_at{HALF}")
        at_half[-1].mkdir()
        (at_half[-1] / f"iter_{HALF:07d}").symlink_to(src / f"iter_{HALF:07d}")
        (at_half[-1] / "latest_checkpointed_iteration.txt").write_text(str(HALF))
    ((serial, dist_serial, resumed, dist_resumed),) = run_distributed(run_many, 1, args=([
        ("stage", _argv(gpt_data, "--save", str(ck))),
        ("stage", _argv(gpt_data, "--save", str(dist_ck), "--ckpt-format", "torch_dist")),
        ("stage", _argv(gpt_data, "--load", str(at_half[0]), "--save", str(at_half[0]))),
        ("stage", _argv(gpt_data, "--load", str(at_half[1]), "--ckpt-format", "torch_dist")),
    ],))
    ref = _curve(serial, "serial")
    assert sorted(ref) == list(range(1, ITERS + 1))
    bias = _legacy_bias(ck)
    assert bias.abs().min() > 0 and not torch.equal(bias, _legacy_bias(ck, iteration=HALF))  # it moved every step
    assert _curve(dist_serial, "serial torch_dist") == ref
    core = read_tensors(str(dist_ck / f"iter_{ITERS:07d}"), trust=True)
    (name,) = [k for k in core if k.endswith("mlp.router.expert_bias")]
    assert name.startswith("decoder.layers.") and torch.equal(core[name].reshape(-1, 4)[0], bias)
    for result, what in ((resumed, "legacy resume"), (dist_resumed, "torch_dist resume")):
        again = _curve(result, what)
        assert sorted(again) == list(range(HALF + 1, ITERS + 1)) and all(again[i] == ref[i] for i in again), what
    assert torch.equal(_legacy_bias(tmp_path / f"ck_at{HALF}"), bias)  # the resumed run saved iteration 8 there
    # tools/checkpoint/convert.py carries the bias and the router's architecture (serial -> EP2 folders)
    convert(["--model-type", "GPT", "--load-dir", str(ck), "--save-dir", str(tmp_path / "conv"),
             "--target-expert-parallel-size", "2"])
    for folder in ("mp_rank_00_000", "mp_rank_00_001"):
        assert torch.equal(_legacy_bias(tmp_path / "conv", folder), bias), folder
    convert(["--model-type", "GPT", "--load-dir", str(ck), "--save-dir", str(tmp_path / "conv_dist"), "--saver",
             "mcore"])  # legacy -> torch_dist
    core = read_tensors(str(tmp_path / "conv_dist" / f"iter_{ITERS:07d}"), trust=True)
    (name,) = [k for k in core if k.endswith("mlp.router.expert_bias")]
    assert torch.equal(core[name].reshape(-1, 4)[0], bias)
    arch = torch.load(tmp_path / "conv" / f"iter_{ITERS:07d}" / "mp_rank_00_000" / "model_optim_rng.pt",
                      weights_only=False)["architecture"]
    assert (arch["moe_router_num_groups"], arch["moe_router_group_topk"], arch["moe_router_enable_expert_bias"]) \
        == (2, 1, True)

    # one group per EP rank's experts, so the bias soon sends a whole micro-batch to one rank and leaves the other's
    # experts idle: both dispatchers still run the same collectives on both ranks
    layouts = {"dp2": (), "ep2-alltoall": ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                           "alltoall"), "ep2-allgather": ("--expert-model-parallel-size", "2"),
               "pp2": ("--pipeline-model-parallel-size", "2")}  # the MoE layer on stage 0 only
    runs = [("stage", _argv(gpt_data, *extra, "--save", str(tmp_path / name))) for name, extra in layouts.items()]
    # DeepSpeed's engine around our MoE layer: the DeepSpeed step applies the update too (ZeRO-1, DP=2)
    zero1 = write_ds_config(str(tmp_path / "zero1.json"), zero_optimization={"stage": 1},
                            train_micro_batch_size_per_gpu=2, train_batch_size=8)
    layouts["zero1"] = ()
    runs.append(("stage", _argv(gpt_data, "--deepspeed", "--deepspeed_config", zero1)))
    results = run_distributed(run_many, 2, args=(runs,))
    for i, name in enumerate(layouts):
        curve = _curve(results[-1][i], name)
        assert sorted(curve) == list(range(1, ITERS + 1)), name
        for it in curve:
            for a, b in zip(curve[it], ref[it]):
                assert math.isclose(a, b, rel_tol=1e-5), f"{name} at iteration {it}: {curve[it]} vs {ref[it]}"
    assert torch.equal(_legacy_bias(tmp_path / "dp2"), bias)
    assert torch.equal(_legacy_bias(tmp_path / "pp2", "mp_rank_00_000"), bias)
    for name in ("ep2-alltoall", "ep2-allgather"):
        for folder in ("mp_rank_00_000", "mp_rank_00_001"):  # each expert rank's own file: the same bias
            assert torch.equal(_legacy_bias(tmp_path / name, folder), bias), (name, folder)
