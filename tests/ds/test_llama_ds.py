"""DeepSpeed with the Llama-style tiny model (RMSNorm, SwiGLU, RoPE, GQA 2 groups, untied output, no biases): ZeRO-1
and ZeRO-3 (DP=2) and the DeepSpeed pipeline engine (GPTModelPipe, PP=2) give the serial 12-step curve within 1e-5
relative (training and validation losses, grad norms). One 2-process job runs the three one after another; the
serial reference is shared with tests/training/test_llama_curves.py (tests/training/_llama.py).
"""
from __future__ import annotations

from pathlib import Path

from tests.dist_utils import run_distributed
from tests.ds._workers import write_ds_config
from tests.training._llama import assert_matches, curve_of, llama_argv, run_many, serial_curve


def test_zero1_zero3_and_ds_pipeline_match_serial(gpt_data: dict, tmp_path: Path) -> None:
    serial = serial_curve(gpt_data)
    batch = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 8}
    cfg = {stage: write_ds_config(str(tmp_path / f"zero{stage}.json"), zero_optimization={"stage": stage}, **batch)
           for stage in (0, 1, 3)}
    ds = ["--deepspeed", "--deepspeed_config"]
    runs = {
        "zero1-dp2": ("stage", llama_argv(gpt_data, *ds, cfg[1])),
        "zero3-dp2": ("stage", llama_argv(gpt_data, *ds, cfg[3])),
        "ds-pipeline-pp2": ("pipe", llama_argv(gpt_data, *ds, cfg[0], "--pipeline-model-parallel-size", "2")),
    }
    results = run_distributed(run_many, 2, args=(list(runs.values()),))
    for i, name in enumerate(runs):
        assert_matches(curve_of(results[-1][i], name), serial, name)
