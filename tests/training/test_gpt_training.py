"""End-to-end GPT pretraining on CPU (gloo): golden loss curve, parallel layouts (TP=2, DP=2 local/torch DDP,
TP=2 x DP=2 with sequence parallelism) equal to serial, exact resume, TensorBoard scalars, checkpoint layout,
SIGTERM save-and-exit and fp16 overflow skipping.

The serial curve is stored in tests/data/golden_gpt_serial.json. Regenerate it (after an intended numerical
change) with:  MEGATRON_REGEN_GOLDEN=1 python -m pytest tests/training/test_gpt_training.py -k golden
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training._workers import curve_from_result, parse_losses, run_pretrain, tiny_gpt_argv

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_gpt_serial.json"
REL_PARALLEL = 1e-5  # parallel layouts vs serial, same machine
REL_GOLDEN = 1e-4  # stored curve vs this machine (BLAS summation order may differ between CPUs)
TB_TAGS = ["learning-rate", "learning-rate vs samples", "batch-size", "batch-size vs samples", "lm loss",
           "lm loss vs samples", "loss-scale", "loss-scale vs samples", "grad-norm", "grad-norm vs samples",
           "params-norm", "num-zeros", "iteration-time", "lm loss validation", "lm loss validation vs samples",
           "lm loss validation ppl", "lm loss validation ppl vs samples"]


def _run(world_size: int, argv: list[str], **kw) -> list[dict]:
    return run_distributed(run_pretrain, world_size, args=(argv,), **kw)


def _assert_close(curve: dict, ref: dict, rel: float, what: str) -> None:
    assert sorted(curve["train"]) == sorted(ref["train"]), f"{what}: iterations differ"
    for it, loss in ref["train"].items():
        assert math.isclose(curve["train"][it], loss, rel_tol=rel), f"{what}: iteration {it}: {curve['train'][it]} vs {loss}"
    assert [p for p, _ in curve["val"]] == [p for p, _ in ref["val"]], f"{what}: validation points differ"
    for (p, a), (_, b) in zip(curve["val"], ref["val"]):
        assert math.isclose(a, b, rel_tol=rel), f"{what}: validation at {p}: {a} vs {b}"


@pytest.fixture(scope="module")
def serial(gpt_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The serial reference run (also writes TensorBoard events and a checkpoint at iteration 20)."""
    out = tmp_path_factory.mktemp("serial")
    argv = tiny_gpt_argv(gpt_data, "--save", str(out / "ckpt"), "--save-interval", "20",
                         "--tensorboard-dir", str(out / "tb"), "--log-batch-size-to-tensorboard",
                         "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard",
                         "--log-params-norm", "--log-num-zeros-in-grad")
    (res,) = _run(1, argv)
    assert res["error"] is None, res["error"]
    curve = curve_from_result(res["result"])  # the numbers pretrain() returns
    assert len(curve["train"]) == 20, res["stdout"][-3000:]
    _assert_close(parse_losses(res["stdout"]), curve, 1e-6, "log lines (%.6E) vs pretrain()'s numbers")
    return {"curve": curve, "stdout": res["stdout"], "dir": out, "result": res["result"]}


def test_serial_matches_golden_curve(serial: dict) -> None:
    curve = serial["curve"]
    losses = [curve["train"][i] for i in range(1, 21)]
    assert losses[-1] < losses[0] - 0.2, "the tiny GPT should learn within 20 steps"
    if os.environ.get("MEGATRON_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps({
            "description": "tests/training/_workers.py::tiny_gpt_argv, serial, fp32, CPU; lm loss per iteration",
            "train": {str(k): v for k, v in curve["train"].items()},
            "val": curve["val"],
        }, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    ref = {"train": {int(k): v for k, v in golden["train"].items()}, "val": [tuple(x) for x in golden["val"]]}
    _assert_close(curve, ref, REL_GOLDEN, "serial vs golden")


@pytest.mark.parametrize("layout", [
    pytest.param((2, ["--tensor-model-parallel-size", "2"]), id="tp2"),
    pytest.param((2, ["--DDP-impl", "local"]), id="dp2-local"),
    pytest.param((2, ["--DDP-impl", "torch"]), id="dp2-torch"),
    pytest.param((4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--save-interval", "20"]),
                 id="tp2-dp2-sp"),
])
def test_parallel_layout_matches_serial(layout, serial: dict, gpt_data: dict, tmp_path: Path) -> None:
    world_size, extra = layout
    if "--save-interval" in extra:
        extra = extra + ["--save", str(tmp_path / "ckpt")]
    results = _run(world_size, tiny_gpt_argv(gpt_data, *extra))
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    last = curve_from_result(results[-1]["result"])  # the last rank holds the losses, as in Megatron
    _assert_close(last, serial["curve"], REL_PARALLEL, f"{extra} vs serial")
    if "--save" in extra:  # only data-parallel rank 0 writes; one folder per tensor-parallel rank
        it_dir = tmp_path / "ckpt" / "iter_0000020"
        assert sorted(d for d in os.listdir(it_dir) if d != "manifest.json") == ["mp_rank_00", "mp_rank_01"]
        sd = torch.load(it_dir / "mp_rank_01" / "model_optim_rng.pt", weights_only=False)
        assert len(sd["rng_state"]) == 2  # one RNG entry per data-parallel rank
        assert sd["args"].tensor_model_parallel_size == 2


def test_checkpoint_layout_and_keys(serial: dict) -> None:
    ckpt = serial["dir"] / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    path = ckpt / "iter_0000020" / "mp_rank_00" / "model_optim_rng.pt"
    assert sorted(os.listdir(ckpt / "iter_0000020" / "mp_rank_00")) == ["model_optim_rng.pt"]  # no temp files left
    from megatron.checkpoint.safe_load import allowed_globals

    with torch.serialization.safe_globals(allowed_globals()):  # no fallback to full unpickling needed
        sd = torch.load(path, weights_only=True)
    for key in ("args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
                "lr_scheduler", "rng_state", "consumed_train_samples", "consumed_valid_samples",
                "consumed_train_tokens", "true_vocab_size", "padded_vocab_size", "architecture"):
        assert key in sd, key
    assert sd["checkpoint_version"] == 3.0 and sd["iteration"] == 20
    assert sd["consumed_train_samples"] == 160 and sd["consumed_train_tokens"] == 160 * 64
    assert sd["padded_vocab_size"] == 5120
    assert sd["architecture"]["num_layers"] == 2 and sd["architecture"]["position_embedding_type"] == "learned_absolute"
    enc = sd["model"]["language_model"]["encoder"]
    assert "layers.1.self_attention.query_key_value.weight" in enc
    assert sd["model"]["language_model"]["embedding"]["word_embeddings"]["weight"].shape == (5120, 64)
    rng = sd["rng_state"][0]
    assert {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"} <= set(rng)


def test_tensorboard_scalars(serial: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(serial["dir"] / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    missing = [t for t in TB_TAGS if t not in tags]
    assert not missing, f"missing tags {missing}; have {sorted(tags)}"
    loss = acc.Scalars("lm loss")
    assert [e.step for e in loss] == list(range(1, 21))
    assert math.isclose(loss[-1].value, serial["curve"]["train"][20], rel_tol=1e-5)
    assert [e.step for e in acc.Scalars("lm loss vs samples")][:2] == [8, 16]
    val = acc.Scalars("lm loss validation")
    assert [e.step for e in val][:2] == [10, 20]
    ppl = acc.Scalars("lm loss validation ppl")
    assert math.isclose(ppl[0].value, math.exp(val[0].value), rel_tol=1e-5)


def test_log_lines_have_megatron_format(serial: dict) -> None:
    line = next(ln for ln in serial["stdout"].splitlines() if ln.startswith(" iteration       20/      20 |"))
    for field in ("consumed samples:          160 |", "consumed tokens:        10240 |",
                  "global batch size:     8 |", "loss scale: 1.0 |", "number of skipped iterations:   0 |",
                  "number of nan iterations:   0 |", "samples per second:", "TFLOPs:", "grad norm:",
                  "params norm:", "num zeros:"):
        assert field in line, (field, line)
    assert " validation loss at iteration 10 | lm loss value: " in serial["stdout"]
    assert " validation loss at the end of training for val data | " in serial["stdout"]
    assert serial["result"]["iteration"] == 20


def test_resume_is_exact(gpt_data: dict, tmp_path: Path) -> None:
    """2N iterations in one go == N, save, resume, N more (with dropout on, so RNG restore matters)."""
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    full = tiny_gpt_argv(gpt_data, *dropout, "--save", str(tmp_path / "a"), "--save-interval", "10")
    (a,) = _run(1, full)
    assert a["error"] is None, a["error"]
    # Pretend the first run stopped after iteration 10: point the tracker at it and resume from there.
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text("10")
    resumed = tiny_gpt_argv(gpt_data, *dropout, "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"),
                            "--save-interval", "10")
    (b,) = _run(1, resumed)
    assert b["error"] is None, b["error"]
    ca, cb = parse_losses(a["stdout"]), parse_losses(b["stdout"])
    assert sorted(cb["train"]) == list(range(11, 21))
    for it in range(11, 21):  # identical to the last printed digit
        assert cb["train"][it] == ca["train"][it], (it, ca["train"][it], cb["train"][it])
    assert cb["val"] == ca["val"][1:]
    assert "successfully loaded checkpoint" in b["stdout"]


def test_sigterm_saves_and_exits(gpt_data: dict, tmp_path: Path) -> None:
    """SIGTERM on rank 0 only: both DP ranks agree, save at the end of that iteration and return."""
    argv = tiny_gpt_argv(gpt_data, "--exit-signal-handler", "--save", str(tmp_path / "ckpt"),
                         "--save-interval", "100", "--global-batch-size", "8")
    results = run_distributed(run_pretrain, 2, args=(argv, 3))  # 1 micro-batch per rank: call 3 = iteration 3
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    assert all(r["result"]["iteration"] == 3 for r in results)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert "exiting program after receiving SIGTERM" in results[0]["stdout"]


def test_fp16_overflow_skips_iterations(gpt_data: dict) -> None:
    """--fp16 with Megatron's initial loss scale 2^32: gradients overflow, steps are skipped, the scale halves."""
    argv = tiny_gpt_argv(gpt_data, "--fp16", "--eval-iters", "0", iters=3)
    (res,) = _run(1, argv)
    assert res["error"] is None, res["error"]
    lines = [ln for ln in res["stdout"].splitlines() if ln.startswith(" iteration ")]
    assert len(lines) == 3
    scales = [float(ln.split("loss scale: ")[1].split(" |")[0]) for ln in lines]
    assert scales == [2.0**32, 2.0**31, 2.0**30]  # hysteresis 2: the first overflow only uses up the hysteresis
    assert all("number of skipped iterations:   1 |" in ln and "lm loss" not in ln for ln in lines)
