"""Multi-token prediction (--mtp-num-layers 2) in training: a tiny Llama-style GPT logs Megatron-LM's `mtp_1 loss`
and `mtp_2 loss` in the log line and in what pretrain() returns; PP=2 (the MTP block on the last stage, the word
embeddings it needs kept equal to the first stage's) and TP=2 + SP give the serial curve (lm loss and both MTP losses
within 1e-5 relative); resuming the PP=2 run from its iteration-5 checkpoint reproduces iterations 6..10 exactly."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.log_lines import iteration_values
from tests.training._llama import run_many
from tests.training._workers import tiny_gpt_argv

pytestmark = pytest.mark.slow

ITERS = 10
NAMES = ("lm loss", "mtp_1 loss", "mtp_2 loss")
MTP = ["--hidden-size", "32", "--seq-length", "32", "--max-position-embeddings", "32", "--ffn-hidden-size", "48",
       "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3",
       "--micro-batch-size", "2"]
LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"],
           "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"]}


def _argv(data: dict, *extra: str) -> list[str]:
    return tiny_gpt_argv(data, *MTP, *extra, iters=ITERS)


def _curve(result: dict, what: str) -> dict:
    assert result["error"] is None, f"{what}: {result['error']}"
    values = [iteration_values(result["stdout"], key) for key in NAMES]
    return {it: tuple(v[it] for v in values) for it in values[0] if all(it in v for v in values)}


def test_mtp_losses_logged_pp2_and_tp2_match_serial_and_resume(gpt_data: dict, tmp_path: Path) -> None:
    ((serial_res,),) = run_distributed(run_many, 1, args=([("stage", _argv(gpt_data))],))
    serial = _curve(serial_res, "serial")
    assert sorted(serial) == list(range(1, ITERS + 1))
    assert all(v[1] > 0 and v[2] > 0 and len(set(v)) == 3 for v in serial.values()), serial  # three losses
    returned = serial_res["result"]["train_losses"][ITERS]
    assert set(NAMES) <= set(returned)
    assert math.isclose(returned["mtp_2 loss"], serial[ITERS][2], rel_tol=1e-5)

    half = ITERS // 2
    saving = _argv(gpt_data, *LAYOUTS["pp2"], "--save", str(tmp_path / "ck"), "--save-interval", str(half))
    runs = [("stage", saving), ("stage", _argv(gpt_data, *LAYOUTS["tp2-sp"]))]
    results = run_distributed(run_many, 2, args=(runs,))[-1]
    for result, name in zip(results, LAYOUTS):
        curve = _curve(result, name)
        assert sorted(curve) == list(range(1, ITERS + 1)), name
        for it in curve:
            for key, a, b in zip(NAMES, curve[it], serial[it]):
                assert math.isclose(a, b, rel_tol=1e-5), f"{name}: {key} at iteration {it}: {a} vs serial {b}"
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text(str(half))
    resume = [("stage", _argv(gpt_data, *LAYOUTS["pp2"], "--load", str(tmp_path / "ck")))]
    (again,) = run_distributed(run_many, 2, args=(resume,))[-1]
    again, full = _curve(again, "pp2 resumed"), _curve(results[0], "pp2 saving")
    assert sorted(again) == list(range(half + 1, ITERS + 1))
    for it in again:
        assert again[it] == full[it], (it, again[it], full[it])
