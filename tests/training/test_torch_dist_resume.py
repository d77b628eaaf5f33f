"""`--ckpt-format torch_dist` with the optimizer state (issue 26): a run saved as one torch_dist folder (Megatron Core
names, layers stacked, the distributed optimizer's state in Megatron Core's fully_reshardable layout) resumes at
another layout and continues the curve of the run that never stopped (pretrain_gpt, fp32, gloo CPU, the tiny GPT
of tests/training/_workers.py; losses from pretrain()'s return value, 1e-5 relative).

A: TP1 x DP2, distributed optimizer, 12 iterations, saves torch_dist at 6 and 12 (the run that never stopped).
B: A's iteration 6 at TP1 x PP2 with the distributed optimizer (another layout: the RNG state is ignored, as
   Megatron-LM does); C: at A's layout with the regular optimizer (the RNG state restored, no --no-load-rng).
Under expert parallelism: a tiny all-MoE model at EP2 saves torch_dist and resumes at EP2, at EP1 x DP2 and at
expert-TP 2 under TP 1, which saves torch_dist again; a model mixing MoE and dense layers (--moe-layer-freq [1,0],
each layer under its own names as Megatron Core's non-homogeneous layers) saves at EP2 and resumes at EP1 x DP2.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training._workers import checkpoint_at as _at
from tests.training._workers import curve_from_result, run_pretrain, tiny_gpt_argv

REL = 1e-5
ITERS, SAVE = 12, 6


def _run(argv: list[str]) -> dict:
    """The last rank's result (it is on the last pipeline stage), with every rank's output."""
    results = run_distributed(run_pretrain, 2, args=(argv,))
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    return dict(results[-1], stdout="".join(r["stdout"] for r in results))


def _assert_continues(resumed: dict, original: dict, what: str) -> None:
    ca, cb = curve_from_result(original["result"]), curve_from_result(resumed["result"])
    assert sorted(cb["train"]) == list(range(SAVE + 1, ITERS + 1)), what
    for it in range(SAVE + 1, ITERS + 1):
        assert math.isclose(cb["train"][it], ca["train"][it], rel_tol=REL), \
            f"{what}: iteration {it}: {cb['train'][it]} vs {ca['train'][it]}"
    ref_val = dict(ca["val"])
    assert cb["val"] and all(math.isclose(loss, ref_val[p], rel_tol=REL) for p, loss in cb["val"]), what


@pytest.mark.slow
def test_torch_dist_with_distributed_optimizer_resumes_on_other_layouts(gpt_data: dict, tmp_path: Path) -> None:
    from megatron.checkpoint.conversion.torch_dist import read_common, read_dcp_metadata

    ckpt = tmp_path / "a"
    a = _run(tiny_gpt_argv(gpt_data, "--use-distributed-optimizer", "--ckpt-format", "torch_dist", "--save",
                           str(ckpt), "--save-interval", str(SAVE), iters=ITERS))
    folder = ckpt / f"iter_{SAVE:07d}"
    assert not any(folder.glob("mp_rank_*"))
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    names = read_dcp_metadata(str(folder)).state_dict_metadata
    for key in ("param", "exp_avg", "exp_avg_sq"):  # Megatron Core's fully_reshardable names, layers stacked
        assert names[f"optimizer.state.{key}.decoder.layers.self_attention.linear_qkv.weight"].size[0] == 2
        assert f"optimizer.state.{key}.embedding.word_embeddings.weight" in names
    common = read_common(str(folder))
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]} == {float(SAVE)}
    assert common["opt_param_scheduler"]["num_steps"] == 8 * SAVE and common["consumed_train_samples"] == 8 * SAVE

    load = _at(ckpt, SAVE, tmp_path)
    b = _run(tiny_gpt_argv(gpt_data, "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2",
                           "--load", str(load), "--auto-detect-ckpt-format", iters=ITERS))
    assert "RNG state will be ignored" in b["stdout"]
    _assert_continues(b, a, "torch_dist TP1xDP2 distopt -> TP1xPP2 distopt")
    c = _run(tiny_gpt_argv(gpt_data, "--load", str(load), "--ckpt-format", "torch_dist", iters=ITERS))
    _assert_continues(c, a, "torch_dist TP1xDP2 distopt -> TP1xDP2 regular optimizer")



@pytest.mark.slow
def test_torch_dist_saved_under_expert_parallelism_resumes_at_ep2_and_ep1(gpt_data: dict, tmp_path: Path) -> None:
    """The tiny MoE of tests/training/test_moe_training.py (every layer MoE) at EP2 with the distributed optimizer
    saves torch_dist (all experts stacked in one folder, their optimizer state with them); resumed at EP2 (distributed
    optimizer) and at DP2 without EP (regular optimizer) it continues the curve (lm loss and load-balancing loss,
    1e-5); so does expert-TP 2 under TP 1 (distributed optimizer), which saves torch_dist at 12 the same weights and
    optimizer moments as the EP2 run (its experts and their distributed-optimizer state gathered whole over the
    expert-TP group). One 2-rank launch."""
    from tests.training._moe_ep_workers import run_steps
    from tests.training.test_moe_training import MOE, _curve, _same

    def argv(*extra: str) -> list[str]:
        return tiny_gpt_argv(gpt_data, *MOE, "--moe-layer-freq", "1", *extra, iters=ITERS)

    ckpt, etp2, mixed = tmp_path / "ep2", tmp_path / "etp2", tmp_path / "mixed"
    ep2 = ["--expert-model-parallel-size", "2"]
    res = run_distributed(run_steps, 2, args=([
        ("train", argv(*ep2, "--use-distributed-optimizer", "--ckpt-format", "torch_dist", "--save", str(ckpt),
                       "--save-interval", str(SAVE))),
        ("tracker", str(ckpt), SAVE),
        ("train", argv(*ep2, "--use-distributed-optimizer", "--load", str(ckpt), "--ckpt-format", "torch_dist")),
        ("train", argv("--load", str(ckpt), "--ckpt-format", "torch_dist")),
        ("train", argv("--expert-tensor-parallel-size", "2", "--use-distributed-optimizer", "--load", str(ckpt),
                       "--ckpt-format", "torch_dist", "--save", str(etp2), "--save-interval", str(SAVE))),
        # MoE and dense layers mixed (--moe-layer-freq [1,0]): saved at EP2 (4 iterations), resumed at 2 at EP1 x DP2
        ("train", tiny_gpt_argv(gpt_data, *MOE, *ep2, "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
                                "--save", str(mixed), "--save-interval", "2", iters=4)),
        ("tracker", str(mixed), 2),
        ("train", tiny_gpt_argv(gpt_data, *MOE, "--load", str(mixed), "--ckpt-format", "torch_dist", iters=4)),
    ],))[-1]
    folder = ckpt / f"iter_{SAVE:07d}"
    assert not any(folder.glob("mp_rank_*")) and (folder / ".metadata").is_file()
    from megatron.checkpoint.conversion.torch_dist import read_dcp_metadata

    names = read_dcp_metadata(str(folder)).state_dict_metadata
    assert names["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size[:2] == (2, 4)  # [layers, experts]
    assert "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight" in names
    full = _curve(res[0], "EP2 saving torch_dist")
    for result, what in ((res[2], "resumed at EP2"), (res[3], "resumed at EP1 x DP2"),
                         (res[4], "resumed at expert-TP 2 (TP 1)")):
        _same(_curve(result, what), full, what, iters=range(SAVE + 1, ITERS + 1), z_loss=False)
    # mixed layers are not stacked: each layer under its own names, as Megatron Core's non-homogeneous layers
    names = read_dcp_metadata(str(mixed / "iter_0000002")).state_dict_metadata
    assert names["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"].size[0] == 4  # [experts, out, in]
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names and "decoder.layers.0.mlp.linear_fc1.weight" not in names
    assert "optimizer.state.exp_avg.decoder.layers.0.mlp.experts.experts.linear_fc2.weight" in names
    _same(_curve(res[7], "mixed resumed at EP1 x DP2"), _curve(res[5], "mixed at EP2"), "mixed layers",
          iters=range(3, 5), z_loss=False)
    # expert-TP 2 != TP 1 saves torch_dist too (its experts gathered whole): iteration 12 holds the weights and
    # optimizer moments of the EP2 run's own iteration 12
    from megatron.checkpoint.conversion.torch_dist import read_iteration_state

    (_, _, ref, ref_opt), (_, _, mine, mine_opt) = (read_iteration_state(str(d / f"iter_{ITERS:07d}"), False)
                                                    for d in (ckpt, etp2))
    assert sorted(mine) == sorted(ref) and any(k.endswith("experts.weight1") for k in mine)
    for key in mine:
        assert torch.allclose(mine[key], ref[key], rtol=1e-4, atol=1e-6), key
    for key in ("exp_avg", "exp_avg_sq"):
        assert sorted(mine_opt[key]) == sorted(ref_opt[key])
        for name in mine_opt[key]:
            assert torch.allclose(mine_opt[key][name], ref_opt[key][name], rtol=1e-3, atol=1e-8), (key, name)
