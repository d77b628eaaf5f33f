"""Expert parallelism end to end: the tiny Mixtral-style MoE GPT of tests/training/test_moe_training.py (4 experts,
top-2, z-loss, gated shared expert, MoE and dense layers mixed) trains the serial run's 20-step curve (lm loss and
load_balancing_loss within 1e-5 relative) with its experts sharded over 2 ranks: EP2 (allgather dispatcher),
EP2 + TP2 + SP (alltoall), EP2 x DP2 with the distributed optimizer and capacity dropping (allgather; the grad
reduction overlapped with backward in several buckets, the expert ones over the expert-data-parallel group),
EP2 x PP2 with capacity dropping (alltoall). Clipping is active and the logged grad norms and zero counts equal the
serial run's (each expert counted once). Resuming EP2 and EP2 x DP2 (distributed optimizer) at iteration 10
reproduces 11..20 exactly; checkpoints use Megatron-LM's per-rank folders with the expert rank
(mp_rank_TT[_PPP]_EEE). tools/checkpoint/convert.py reshapes EP2 -> EP1 (a serial run continues the curve) and
EP1 -> EP2 (an EP2 run under --use-checkpoint-args continues it), optimizer state included.
--expert-tensor-parallel-size different from TP (Megatron-LM core's expert grid): TP2 + SP with ETP1 x EP2 and the
distributed optimizer (experts whole on each rank, reduced over the TP ranks' expert-data-parallel group; saved in
Megatron-LM's folders mp_rank_00_000 / mp_rank_01_001, resumed exactly) and TP1 with ETP2 x EP2 (alltoall) give the
serial curve and grad norms. Interleaved PP3 (2 virtual stages) x EP2 gives the serial curve of a 6-layer model;
bf16 x EP2 x DP2 trains close to the fp32 serial curve; fp16 x EP2 (dynamic loss scale with overflows) skips the
same steps as the serial fp16 run, at its loss scale / DP, with its curve and grad norms. Four process launches
(2, 1, 4 and 6 ranks)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from megatron.layers.checkpoint_keys import flatten_checkpoint_state_dict
from tests.dist_utils import run_distributed
from tests.log_lines import iteration_values
from tests.training._moe_ep_workers import run_steps
from tests.training.test_moe_training import CAPACITY, ITERS, TP2, _curve, _same
from tests.training.test_moe_training import _argv as _moe_argv

pytestmark = pytest.mark.slow

EP2 = ["--expert-model-parallel-size", "2"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
# interleaved PP (Megatron 23.06: PP > 2) x EP2: 6 layers, 2 virtual stages of 1 layer, 3 micro-batches per replica
INTERLEAVED = ["--num-layers", "6", "--moe-layer-freq", "[1,0,1,0,1,0]", "--global-batch-size", "12",
               "--train-iters", "6"]
HALF = ITERS // 2
CLIP = 0.6  # below the tiny model's grad norms after a few steps: clipping (and so the norm) shapes the curves
# fp16 with a dynamic loss scale that grows every 4 steps into overflows (skipped steps, hysteresis 2). Under EP2 each
# rank is also a data-parallel rank: as in Megatron-LM its loss is divided by its own 2 micro-batches (the serial
# run's by 4) and the grads averaged over DP after the backward, so its fp16 backward carries twice the serial values:
# at half the serial run's loss scale it is the same scaled computation (the scale is a power of two).
FP16 = ["--fp16", "--loss-scale-window", "4"]
FP16_SCALE = 131072


def _argv(data: dict, *extra: str) -> list[str]:
    return _moe_argv(data, *extra, "--clip-grad", str(CLIP), "--log-num-zeros-in-grad")


NORM = re.compile(r" iteration +(\d+)/ *\d+ \|.*? grad norm: ([0-9.]+) \| num zeros: ([0-9.]+) \|")


def _norms_match(result: dict, ref: dict, what: str) -> None:
    """The logged grad norms (3 decimals) and zero counts equal the serial run's: each expert counted once over the
    EP ranks."""
    mine, theirs = ({int(i): float(v) for i, v, _ in NORM.findall(r["stdout"])} for r in (result, ref))
    zeros, zeros_ref = ({int(i): float(z) for i, _, z in NORM.findall(r["stdout"])} for r in (result, ref))
    assert zeros == zeros_ref, f"{what}: zero counts {zeros} vs serial {zeros_ref}"
    assert sorted(mine) == list(range(1, ITERS + 1)), f"{what}: grad norms {sorted(mine)}"
    assert max(theirs.values()) > CLIP, f"--clip-grad {CLIP} should clip some steps"
    for it, norm in mine.items():
        assert abs(norm - theirs[it]) <= 2e-3, f"{what}: grad norm {norm} at iteration {it}, serial {theirs[it]}"


def _fp16_matches(result: dict, ref: dict) -> None:
    """fp16 x EP2 at half the serial loss scale: the scale is half the serial's at every step, the same steps are
    skipped (overflow found on every rank alike), grad norms equal (3 decimals), lm loss within fp16 rounding."""
    assert result["error"] is None and ref["error"] is None, (result["error"], ref["error"])
    scale, skipped, loss, norm = ([iteration_values(r["stdout"], key) for r in (result, ref)] for key in
                                  ("loss scale", "number of skipped iterations", "lm loss", "grad norm"))
    assert sorted(scale[1]) == list(range(1, ITERS + 1)), f"fp16 serial: iterations {sorted(scale[1])}"
    assert {it: 2 * s for it, s in scale[0].items()} == scale[1], f"fp16 x EP2 loss scales {scale}"
    assert skipped[0] == skipped[1] and 2 <= sum(skipped[1].values()) <= 8, f"fp16 skipped iterations {skipped}"
    assert sorted(loss[0]) == sorted(loss[1]) == [it for it in skipped[1] if not skipped[1][it]]  # no loss if skipped
    for it in loss[1]:
        assert math.isclose(loss[0][it], loss[1][it], rel_tol=1e-4), ("fp16 x EP2 lm loss", it, loss)
        assert abs(norm[0][it] - norm[1][it]) <= 2e-3, ("fp16 x EP2 grad norm", it, norm)


def _exact(curve: dict, ref: dict, what: str) -> None:
    assert sorted(curve) == list(range(HALF + 1, ITERS + 1)), f"{what}: iterations {sorted(curve)}"
    for it in curve:
        assert curve[it] == ref[it], (what, it, curve[it], ref[it])


def test_expert_parallel_layouts_match_serial_and_resume(gpt_data: dict, tmp_path: Path) -> None:
    def save(name: str) -> list[str]:
        return ["--save", str(tmp_path / name), "--save-interval", str(HALF)]

    # 2 ranks: EP2 (allgather), saving at 10; resumed at 10; converted EP2 -> EP1 and EP1 -> EP2 (with optimizer
    # state), the latter resumed under --use-checkpoint-args (which restores --expert-model-parallel-size 2)
    ep2 = [*EP2, *save("ep2")]

    def convert(src: str, dst: str, ep: int, *extra: str) -> tuple:
        return ("convert", ["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir",
                            str(tmp_path / src), "--save-dir", str(tmp_path / dst),
                            "--target-expert-parallel-size", str(ep), *extra])

    res = run_distributed(run_steps, 2, args=([
        ("train", _argv(gpt_data, *ep2)),
        ("tracker", str(tmp_path / "ep2"), HALF),
        ("train", _argv(gpt_data, *EP2, "--load", str(tmp_path / "ep2"))),
        convert("ep2", "ep1", 1),
        convert("ep1", "ep2-again", 2),
        ("train", _argv(gpt_data, *ALLTOALL, "--load", str(tmp_path / "ep2-again"), "--no-load-rng",
                        "--use-checkpoint-args")),
        ("train", _argv(gpt_data, *EP2, *FP16, "--initial-loss-scale", str(FP16_SCALE // 2))),
    ],))[-1]
    iter_dir = tmp_path / "ep2" / f"iter_{HALF:07d}"
    assert sorted(p.name for p in iter_dir.iterdir() if p.name.startswith("mp_rank")) == \
        ["mp_rank_00_000", "mp_rank_00_001"]  # Megatron-LM's folder per expert rank
    assert (tmp_path / "ep1" / f"iter_{HALF:07d}" / "mp_rank_00" / "distrib_optim.pt").is_file()
    assert (tmp_path / "ep2-again" / f"iter_{HALF:07d}" / "mp_rank_00_001" / "distrib_optim.pt").is_file()

    serial_runs = run_distributed(run_steps, 1, args=(
        [("train", _argv(gpt_data)), ("train", _argv(gpt_data, *CAPACITY)),
         ("train", _argv(gpt_data, "--load", str(tmp_path / "ep1"), "--no-load-rng")),
         ("train", _argv(gpt_data, *INTERLEAVED)),
         ("train", _argv(gpt_data, *FP16, "--initial-loss-scale", str(FP16_SCALE)))],))[0]
    serial, capacity, from_ep1 = (_curve(r, what) for r, what in zip(serial_runs, (
        "serial", "capacity", "EP2 -> EP1 converted")))
    _norms_match(res[0], serial_runs[0], "EP2")
    assert serial != capacity  # tokens were dropped
    full = _curve(res[0], "ep2")
    _same(full, serial, "EP2", z_loss=False)
    _exact(_curve(res[2], "ep2 resumed"), full, "EP2 resumed")
    second_half = range(HALF + 1, ITERS + 1)
    _same(from_ep1, serial, "serial run from EP2 -> EP1 converted", iters=second_half, z_loss=False)
    _same(_curve(res[5], "EP1 -> EP2"), serial, "EP2 run from EP1 -> EP2 converted", iters=second_half,
          z_loss=False)
    _fp16_matches(res[6], serial_runs[4])

    # 4 ranks: EP2 + TP2 + SP, EP2 x DP2 + distributed optimizer (saving at 10, resumed), EP2 x PP2; expert-TP != TP
    # (TP2 + ETP1 x EP2 with the distributed optimizer and TP1 + ETP2 x EP2 with the regular one, each saving at 10
    # and resumed; converted to TP1 EP1 (run at DP4) and to TP2 ETP2 EP2, both continuing the serial curve);
    # bf16 x EP2 x DP2
    distopt = [*EP2, "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000", *CAPACITY]
    etp1 = [*EP2, *TP2, "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer"]
    etp2 = [*EP2, "--expert-tensor-parallel-size", "2", *ALLTOALL]
    tp_to = ("--target-tensor-parallel-size", "--target-pipeline-parallel-size", "1")
    res = run_distributed(run_steps, 4, args=([
        ("train", _argv(gpt_data, *EP2, *TP2, *ALLTOALL)),
        ("train", _argv(gpt_data, *distopt, *save("distopt"))),
        ("tracker", str(tmp_path / "distopt"), HALF),
        ("train", _argv(gpt_data, *distopt, "--load", str(tmp_path / "distopt"))),
        ("train", _argv(gpt_data, *EP2, "--pipeline-model-parallel-size", "2", *CAPACITY, *ALLTOALL)),
        ("train", _argv(gpt_data, *etp1, *save("etp1"))),
        ("tracker", str(tmp_path / "etp1"), HALF),
        ("train", _argv(gpt_data, *etp1, "--load", str(tmp_path / "etp1"))),
        ("train", _argv(gpt_data, *etp2, *save("etp2"))),
        ("train", _argv(gpt_data, *EP2, "--bf16")),
        ("tracker", str(tmp_path / "etp2"), HALF),
        ("train", _argv(gpt_data, *etp2, "--load", str(tmp_path / "etp2"))),
        convert("etp1", "etp1-tp1", 1, tp_to[0], "1", *tp_to[1:]),
        convert("etp2", "etp2-tp2", 2, tp_to[0], "2", *tp_to[1:]),
        ("train", _argv(gpt_data, "--load", str(tmp_path / "etp1-tp1"), "--no-load-rng")),
        ("train", _argv(gpt_data, *EP2, *TP2, "--load", str(tmp_path / "etp2-tp2"), "--no-load-rng")),
    ],))[-1]
    _same(_curve(res[0], "ep2-tp2-sp"), serial, "EP2 + TP2 + SP", z_loss=False)
    _norms_match(res[0], serial_runs[0], "EP2 + TP2 + SP")
    _norms_match(res[1], serial_runs[1], "EP2 x DP2 distributed optimizer")
    _norms_match(res[4], serial_runs[1], "EP2 x PP2")
    full = _curve(res[1], "ep2-dp2-distopt")
    _same(full, capacity, "EP2 x DP2 distributed optimizer", z_loss=False)
    _exact(_curve(res[3], "ep2-dp2-distopt resumed"), full, "EP2 x DP2 distributed optimizer resumed")
    _same(_curve(res[4], "ep2-pp2"), capacity, "EP2 x PP2", z_loss=False)
    assert (tmp_path / "distopt" / f"iter_{HALF:07d}" / "mp_rank_00_001" / "distrib_optim.pt").is_file()
    # expert-TP != TP: the serial curve and grad norms; Megatron-LM's folders (TP rank, expert rank) of the writers
    full = _curve(res[5], "tp2-etp1-ep2")
    _same(full, serial, "TP2 + ETP1 x EP2 distributed optimizer", z_loss=False)
    _norms_match(res[5], serial_runs[0], "TP2 + ETP1 x EP2")
    _exact(_curve(res[7], "tp2-etp1-ep2 resumed"), full, "TP2 + ETP1 x EP2 resumed")
    assert sorted(p.name for p in (tmp_path / "etp1" / f"iter_{HALF:07d}").iterdir() if p.name.startswith("mp_")) \
        == ["mp_rank_00_000", "mp_rank_01_001"]
    full = _curve(res[8], "tp1-etp2-ep2")
    _same(full, serial, "TP1 + ETP2 x EP2 (alltoall)", z_loss=False)
    _norms_match(res[8], serial_runs[0], "TP1 + ETP2 x EP2")
    _exact(_curve(res[11], "tp1-etp2-ep2 resumed"), full, "TP1 + ETP2 x EP2 resumed")
    # expert-TP 2 ranks 0/1 and 2/3 share the folders of expert ranks 0 and 1, which hold their experts whole
    etp2_dir = tmp_path / "etp2" / f"iter_{HALF:07d}"
    assert sorted(p.name for p in etp2_dir.iterdir() if p.name.startswith("mp_")) == ["mp_rank_00_000",
                                                                                      "mp_rank_00_001"]
    saved = torch.load(etp2_dir / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    (w1,) = [v for k, v in flatten_checkpoint_state_dict(saved["model"]).items() if k.endswith("experts.weight1")]
    assert w1.shape == (2, 32, 2 * 48)  # 2 local experts of 4, hidden 32, [gate | up] of ffn 48 (not 48 / 2 each)
    moments = saved["optimizer"].get("optimizer", saved["optimizer"])["state"].values()
    assert sum(m["exp_avg"].shape == w1.shape for m in moments) == 1  # the MoE layer's weight1 moments, whole too
    for result, what in ((res[14], "TP2 + ETP1 x EP2 converted to TP1 EP1 (DP4)"),
                         (res[15], "TP1 + ETP2 x EP2 converted to TP2 ETP2 x EP2")):
        _same(_curve(result, what), serial, what, iters=second_half, z_loss=False)
    bf16, fp32 = _curve(res[9], "bf16 x ep2"), serial
    assert sorted(bf16) == list(range(1, ITERS + 1))
    for it in bf16:  # bf16 rounding, not a different computation: within 1% of the fp32 serial curve
        assert math.isclose(bf16[it][0], fp32[it][0], rel_tol=1e-2), ("bf16 lm loss", it, bf16[it], fp32[it])
        assert math.isclose(bf16[it][1], fp32[it][1], rel_tol=1e-2), ("bf16 load balancing", it, bf16[it], fp32[it])

    # 6 ranks: interleaved PP3 (2 virtual stages) x EP2
    (res,) = run_distributed(run_steps, 6, args=([
        ("train", _argv(gpt_data, *EP2, *INTERLEAVED, "--pipeline-model-parallel-size", "3",
                        "--num-layers-per-virtual-pipeline-stage", "1", *ALLTOALL))],))[-1:]
    _same(_curve(res[0], "interleaved pp3 x ep2"), _curve(serial_runs[3], "serial 6 layers"), "interleaved PP3 x EP2",
          iters=range(1, 7), z_loss=False)
