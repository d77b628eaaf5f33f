"""A tiny Mixtral-style MoE GPT (4 experts, top-2, z-loss, a gated shared expert, one MoE and one dense layer)
trains the serial run's 20-step curve (lm loss, load_balancing_loss and z_loss within 1e-5 relative) under PP=2
and DP=2 with the distributed optimizer (both with capacity dropping) and TP=2 + SP; resuming TP=2 + SP at
iteration 10 reproduces 11..20 exactly, and so does (1e-5) a serial run from that checkpoint converted to TP=1; DeepSpeed ZeRO-1 and ZeRO-2 (DP=2) around our MoE layer give the serial
curve too, and so does full activation recomputation (serial).
Megatron-LM's MoE log entries appear in the log line and in what pretrain() returns. Unimplemented MoE flags and
impossible layouts are one-line errors."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron.arguments import ArgumentError, parse_args, validate_args
from megatron.presets import get_preset
from tests.dist_utils import run_distributed
from tests.ds._workers import write_ds_config
from tests.log_lines import iteration_values
from tests.training._llama import run_many
from tests.training._workers import tiny_gpt_argv

ITERS = 20
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MOE = ["--hidden-size", "32", "--seq-length", "32", "--max-position-embeddings", "32", "--ffn-hidden-size", "48",
       "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate", "--moe-layer-freq", "[1,0]",
       "--micro-batch-size", "2", "--eval-interval", "10"]
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]  # top-2 with dropping (capacity per micro-batch)
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# Under TP+SP Megatron-LM's router sees each rank's sequence slice (so capacity would be per slice): TP runs dropless.
LAYOUTS = {
    "pp2-capacity": ["--pipeline-model-parallel-size", "2", *CAPACITY],
    "dp2-distopt-capacity": ["--use-distributed-optimizer", *CAPACITY],
    "tp2-sp": TP2,
}
pytestmark = pytest.mark.slow


def _argv(data: dict, *extra: str) -> list[str]:
    return tiny_gpt_argv(data, *MOE, *extra, iters=ITERS)


def _curve(result: dict, what: str) -> dict:
    assert result["error"] is None, f"{what}: {result['error']}"
    lm, lbl, z = (iteration_values(result["stdout"], key) for key in ("lm loss", "load_balancing_loss", "z_loss"))
    return {it: (lm[it], lbl[it], z[it]) for it in lm if it in lbl and it in z}


def _same(curve: dict, ref: dict, what: str, iters=range(1, ITERS + 1), z_loss: bool = True) -> None:
    """lm loss and load_balancing_loss equal the serial run's (and z_loss when asked: Megatron-LM logs the printing
    rank's own z-loss, neither summed over TP nor averaged over DP, so only pipeline layouts reproduce it)."""
    assert sorted(curve) == list(iters), f"{what}: iterations {sorted(curve)}"
    names = ("lm loss", "load_balancing_loss", "z_loss")[:3 if z_loss else 2]
    for it in iters:
        for name, a, b in zip(names, curve[it], ref[it]):
            assert math.isclose(a, b, rel_tol=1e-5), f"{what}: {name} at iteration {it}: {a} vs serial {b}"


def test_moe_layouts_match_serial_and_resume(gpt_data: dict, tmp_path: Path) -> None:
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    ((serial_res, capacity_res, recompute_res),) = run_distributed(
        run_many, 1, args=([("stage", _argv(gpt_data)), ("stage", _argv(gpt_data, *CAPACITY)),
                            ("stage", _argv(gpt_data, *CAPACITY, *recompute))],))
    serial, capacity = _curve(serial_res, "serial"), _curve(capacity_res, "serial with capacity")
    assert serial != capacity  # tokens were dropped
    # full recompute: the router runs again in backward; its losses are attached and recorded once
    _same(_curve(recompute_res, "recompute"), capacity, "full recompute")
    assert sorted(serial) == list(range(1, ITERS + 1))
    assert serial[ITERS][0] < serial[1][0] - 0.05, "the tiny MoE model should learn"
    assert all(v[1] > 0.5 and v[2] > 0 for v in serial.values())  # balanced routing gives ~1 (E * sum f_i P_i)
    returned = serial_res["result"]["train_losses"][ITERS]
    assert {"lm loss", "load_balancing_loss", "z_loss"} <= set(returned)
    assert math.isclose(returned["load_balancing_loss"], serial[ITERS][1], rel_tol=1e-5)

    half = ITERS // 2
    runs = [("stage", _argv(gpt_data, *extra)) for extra in LAYOUTS.values()]
    runs.append(("stage", _argv(gpt_data, *TP2, "--save", str(tmp_path / "ck"), "--save-interval", str(half))))
    batch = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 8}
    zero = {stage: write_ds_config(str(tmp_path / f"zero{stage}.json"), zero_optimization={"stage": stage}, **batch)
            for stage in (1, 2)}
    runs += [("stage", _argv(gpt_data, *CAPACITY, "--deepspeed", "--deepspeed_config", zero[stage]))
             for stage in (1, 2)]
    results = run_distributed(run_many, 2, args=(runs,))
    for i, name in enumerate(LAYOUTS):
        ref = capacity if "capacity" in name else serial
        _same(_curve(results[-1][i], name), ref, name, z_loss=name.startswith("pp2"))
    for i, stage in enumerate((1, 2)):  # DeepSpeed's engine around our MoE layer, DP=2
        _same(_curve(results[-1][len(LAYOUTS) + 1 + i], f"zero{stage}"), capacity, f"ZeRO-{stage}", z_loss=False)
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text(str(half))
    resume = [("stage", _argv(gpt_data, *TP2, "--load", str(tmp_path / "ck")))]
    (again,) = run_distributed(run_many, 2, args=(resume,))[-1]
    again = _curve(again, "tp2-sp resumed")
    full = _curve(results[-1][3], "tp2-sp saving")
    assert sorted(again) == list(range(half + 1, ITERS + 1))
    for it in again:
        assert again[it] == full[it], (it, again[it], full[it])
    # tools/checkpoint/convert.py reshapes the MoE checkpoint (experts' TP slices, optimizer state) to TP=1, and a
    # serial run continues the curve from it.
    from megatron.checkpoint.conversion.driver import main as convert

    summary = convert(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir",
                       str(tmp_path / "ck"), "--save-dir", str(tmp_path / "tp1"), "--target-tensor-parallel-size", "1"])
    assert summary["meta"].extra["optimizer"]["step"] == half
    ((tp1,),) = run_distributed(run_many, 1, args=([("stage", _argv(gpt_data, "--load", str(tmp_path / "tp1"),
                                                                    "--no-load-rng"))],))
    _same(_curve(tp1, "TP2+SP -> TP1 converted"), serial, "TP2+SP -> TP1 converted", iters=range(half + 1, ITERS + 1))


BASE = [*get_preset("gpt_micro_test").argv(), "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100", "--num-experts", "4", "--disable-bias-linear"]


@pytest.mark.parametrize("flags, named", [
    (["--expert-tensor-parallel-size", "4"], "--expert-tensor-parallel-size"),  # world size 2
    (["--expert-model-parallel-size", "4"], "--expert-model-parallel-size"),
    (["--expert-model-parallel-size", "2", "--deepspeed", "--deepspeed_config", str(EXAMPLES / "ds_config_gpt.json"),
      "--micro-batch-size", "1", "--global-batch-size", "16", "--fp16"], "--deepspeed"),
    (["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias"),
    (["--moe-input-jitter-eps", "0.1"], "--moe-input-jitter-eps"),
    (["--moe-router-num-groups", "2"], "--moe-router-num-groups"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type"),
    (["--moe-router-load-balancing-type", "global_aux_loss"], "global_aux_loss"),
    (["--deepspeed", "--deepspeed_config", str(EXAMPLES / "ds_config_gpt.json"), "--pipeline-model-parallel-size",
      "2", "--micro-batch-size", "1", "--global-batch-size", "16", "--fp16"], "pipeline engine"),
])
def test_unimplemented_moe_flags_are_refused_with_one_line(flags, named):
    args = parse_args(args=[*BASE, *flags])
    args.rank, args.world_size = 1, 2
    with pytest.raises(ArgumentError) as info:
        validate_args(args, {})
    assert named in str(info.value) and "\n" not in str(info.value)


def test_moe_biases_need_expert_tp_equal_to_tp_and_sequence_parallel_with_tp():
    args = parse_args(args=[*BASE[:-1]])  # expert biases (GPT-OSS): accepted
    args.rank = 1
    assert validate_args(args, {}).add_bias_linear
    args = parse_args(args=[*BASE[:-1], "--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--expert-tensor-parallel-size", "1"])
    args.rank, args.world_size = 1, 2
    with pytest.raises(ArgumentError, match="--expert-tensor-parallel-size equal to"):
        validate_args(args, {})
    args = parse_args(args=[*BASE[:-1], "--ckpt-format", "torch_dist"])
    args.rank = 1
    with pytest.raises(ArgumentError, match="use --ckpt-format torch$"):
        validate_args(args, {})
    args = parse_args(args=[*BASE, "--tensor-model-parallel-size", "2"])
    args.rank, args.world_size = 1, 2
    with pytest.raises(ArgumentError, match="--sequence-parallel"):
        validate_args(args, {})


def test_checkpoint_architecture_holds_and_restores_the_moe_settings():
    """The checkpoint's architecture records the MoE layout; --use-checkpoint-args restores it; a run whose MoE
    flags differ is stopped with one line naming the field."""
    from megatron.checkpoint.args import ArchitectureMismatchError, architecture_from_args, flag_defaults
    from megatron.compat import check_architecture, restore_architecture

    saved_args = parse_args(args=[*BASE, "--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-layer-freq",
                                  "[1,0]", "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate",
                                  "--moe-expert-capacity-factor", "1.5"])
    saved_args.rank = 1
    saved = architecture_from_args(validate_args(saved_args, {}))
    assert (saved["num_moe_experts"], saved["moe_router_topk"], saved["moe_layer_freq"]) == (4, 1, [1, 0])
    plain = parse_args(args=[*BASE[:-3], "--disable-bias-linear"])  # no --num-experts
    restored = restore_architecture(plain, saved, None, flag_defaults())
    assert "num_experts" in restored and plain.num_experts == 4
    plain.rank = 1
    again = architecture_from_args(validate_args(plain, {}))
    assert {k: again[k] for k in saved if k.startswith(("num_moe", "moe_"))} == \
        {k: v for k, v in saved.items() if k.startswith(("num_moe", "moe_"))}
    other = parse_args(args=[*BASE, "--moe-router-topk", "2"])
    other.rank = 1
    with pytest.raises(ArchitectureMismatchError, match="moe_router_topk"):
        check_architecture(saved, validate_args(other, {}), "ckpt")


def test_moe_per_layer_values_and_their_average():
    """The tracker's per-layer values: the log entry averages them over the MoE layers and the micro-batches;
    --moe-per-layer-logging also gives moe/<name>_layer_<i> (written to TensorBoard only)."""
    import torch

    from megatron.core import aux_losses

    aux_losses.clear()
    for _ in range(2):  # two micro-batches
        aux_losses.record("load_balancing_loss", torch.tensor(1.0), 1, 3)
        aux_losses.record("load_balancing_loss", torch.tensor(3.0), 3, 3)
    declared = [aux_losses.AuxLoss("load_balancing_loss", 3, 2, True, None, "moe/load_balancing_loss"),
                aux_losses.AuxLoss("z_loss", 3, 2)]
    out, per_layer = aux_losses.reduce_named_losses(declared, 0.5)
    assert out == {"load_balancing_loss": 2.0, "z_loss": 0.0}
    assert per_layer == {f"moe/load_balancing_loss_layer_{i}": v for i, v in enumerate([1.0, 0.0, 3.0])}
    assert aux_losses.tracked() == {}
