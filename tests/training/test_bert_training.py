"""pretrain_bert.py end to end on a tiny BERT (tests/training/_bert.py): the serial run learns and logs Megatron's
`lm loss` / `sop loss` keys; TP=2 + SP, PP=2, DP=2 + distributed optimizer, DeepSpeed ZeRO-2, TP=2 x PP=2 and PP=4
interleaved (8 layers, selective recompute) train the serial curve (lm and sop losses, validation, grad norms; 1e-5
relative); resuming DP=2 + distributed optimizer at iteration 6 reproduces iterations 7..12 exactly;
--bert-no-binary-head trains the masked LM alone; bf16 steps stay within 1% of fp32; an fp16 overflow step is
skipped; the DeepSpeed pipeline is refused with one line.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.ds._workers import write_ds_config
from tests.training._bert import (
    ITERS,
    assert_matches,
    bert_argv,
    curve_of,
    run_many,
    serial_curve,
    session_bert_data,
)


@pytest.fixture(scope="module")
def bert_data(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return session_bert_data(shared_data, tmp_path_factory)


@pytest.fixture(scope="module")
def serial(bert_data: dict) -> dict:
    return serial_curve(bert_data)


def test_serial_run_learns_and_logs_megatron_keys(serial: dict) -> None:
    assert sorted(serial["train"]) == list(range(1, ITERS + 1))
    assert [v[0] for v in serial["val"]] == [*(f"iteration {i}" for i in range(6, ITERS + 1, 6)),
                                        "the end of training for val data"]
    assert all(0.3 < sop < 1.2 for _, sop in serial["train"].values())  # a 2-way cross entropy


def test_two_process_layouts_match_serial_and_resume_exactly(serial: dict, bert_data: dict, tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    zero2 = write_ds_config(str(tmp_path / "zero2.json"), zero_optimization={"stage": 2},
                            train_micro_batch_size_per_gpu=2, train_batch_size=8)
    distopt = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000"]
    layouts = {
        "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "pp2": ["--pipeline-model-parallel-size", "2"],
        "dp2-distopt": [*distopt, "--save", str(save), "--save-interval", str(ITERS // 2)],
        "zero2-dp2": ["--deepspeed", "--deepspeed_config", zero2],
    }
    runs = [(bert_argv(bert_data, *extra), None) for extra in layouts.values()]
    runs.append((bert_argv(bert_data, *distopt, "--load", str(save)), (str(save), ITERS // 2)))
    results = run_distributed(run_many, 2, args=(runs,))
    last = results[-1]
    for i, name in enumerate(layouts):
        assert_matches(curve_of(last[i], name), serial, name)
    assert curve_of(results[0][1], "pp2 first stage")["train"] == {}  # only the last stage prints losses
    full, again = curve_of(last[2], "dp2-distopt"), curve_of(last[4], "dp2-distopt resumed")
    assert sorted(again["train"]) == list(range(ITERS // 2 + 1, ITERS + 1))
    for it in again["train"]:  # identical to the last printed digit
        assert again["train"][it] == full["train"][it], (it, full["train"][it], again["train"][it])
        assert again["grad_norm"][it] == full["grad_norm"][it]
    assert again["val"] == full["val"][1:]


def test_tp2_pp2_and_pp4_interleaved_match_serial(serial: dict, bert_data: dict) -> None:
    tp2pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
    interleaved = ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
                   "--recompute-activations"]
    runs = [(bert_argv(bert_data, *tp2pp2), None), (bert_argv(bert_data, *interleaved, layers=8), None)]
    results = run_distributed(run_many, 4, args=(runs,))
    assert_matches(curve_of(results[-1][0], "tp2-sp-pp2"), serial, "TP=2 (+SP) x PP=2")
    assert_matches(curve_of(results[-1][1], "pp4-interleaved"), serial_curve(bert_data, layers=8),
                   "PP=4 interleaved (2 chunks per stage) + selective recompute")


def test_no_binary_head_bf16_fp16_overflow_and_ds_pipeline_refusal(serial: dict, bert_data: dict,
                                                                   tmp_path: Path) -> None:
    ds0 = write_ds_config(str(tmp_path / "zero0.json"), zero_optimization={"stage": 0},
                          train_micro_batch_size_per_gpu=2, train_batch_size=8)
    runs = [
        (bert_argv(bert_data, "--bert-no-binary-head", "--eval-iters", "0", iters=4), None),
        (bert_argv(bert_data, "--fp16", "--eval-iters", "0", iters=3), None),
        (bert_argv(bert_data, "--bf16", "--exit-interval", "2"), None),
        (bert_argv(bert_data, "--deepspeed", "--deepspeed_config", ds0, "--pipeline-model-parallel-size", "2"), None),
    ]
    no_binary, fp16, bf16, ds_pipe = run_distributed(run_many, 2, args=(runs,))[-1]  # the last rank logs

    assert no_binary["error"] is None, no_binary["error"]
    lines = [ln for ln in no_binary["stdout"].splitlines() if ln.startswith(" iteration ")]
    lm = [float(ln.split("lm loss: ")[1].split(" |")[0]) for ln in lines]
    assert len(lm) == 4 and lm[-1] < lm[0] and not any("sop loss" in ln for ln in lines)

    assert fp16["error"] is None, fp16["error"]
    lines = [ln for ln in fp16["stdout"].splitlines() if ln.startswith(" iteration ")]
    scales = [float(ln.split("loss scale: ")[1].split(" |")[0]) for ln in lines]
    assert scales == [2.0**32, 2.0**31, 2.0**30]  # Megatron's initial scale overflows; hysteresis 2
    assert all("number of skipped iterations:   1 |" in ln and "lm loss" not in ln for ln in lines)

    bf16 = curve_of(bf16, "bf16")["train"]  # the serial run's first two steps, in bf16
    assert sorted(bf16) == [1, 2]
    for it in (1, 2):
        for a, b in zip(bf16[it], serial["train"][it]):
            assert abs(a - b) <= 1e-2 * b, (it, bf16[it], serial["train"][it])

    assert ds_pipe["error"] is not None and "\n" not in ds_pipe["error"]
    assert "no DeepSpeed pipeline model" in ds_pipe["error"]
