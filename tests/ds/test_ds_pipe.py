"""DeepSpeed's pipeline engine with GPTModelPipe (CPU, gloo, fp32).

- A one-stage GPTModelPipe computes GPTModel's loss for the same weights (1e-6), and the pipe-layer <-> Megatron
  state-dict mapping round-trips GPTModel.state_dict() exactly.
- 20 training steps under ``--deepspeed --pipeline-model-parallel-size 2`` (ZeRO-0, 2 processes) and TP=2 x PP=2
  (ZeRO-1, 4 processes), started from the serial model's weights, give the serial non-DeepSpeed curve within 1e-5
  relative (training and validation losses; grad norms too).
- Pipe checkpoints: ``global_step10/layer_XX-model_00-model_states.pt`` files; resuming at 10 reproduces 11..20.
- ZeRO-2 with PP=2 under --deepspeed stops at start-up with a one-line message; so do --sequence-parallel and a
  layer count not divisible by the pipeline size when GPTModelPipe is built.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.ds._pipe_workers import pipe_forward_worker, run_pretrain_ds_serial_init
from tests.ds._workers import run_pretrain_ds, write_ds_config
from tests.pipeline._workers import run_pretrain_serial_init
from tests.training._workers import parse_losses, tiny_gpt_argv

REL = 1e-5
GRAD_NORM_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.]+) \|")


def _grad_norms(stdout: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in GRAD_NORM_RE.finditer(stdout)}


def _assert_close(curve: dict, ref: dict, what: str, iters=range(1, 21)) -> None:
    assert sorted(curve["train"]) == list(iters), f"{what}: iterations {sorted(curve['train'])}"
    for it in iters:
        a, b = curve["train"][it], ref["train"][it]
        assert math.isclose(a, b, rel_tol=REL), f"{what}: iteration {it}: {a} vs serial {b}"


def test_pipe_forward_matches_gpt_model_and_mapping_round_trips() -> None:
    (res,) = run_distributed(pipe_forward_worker, 1)
    assert res["class_name"] == "GPTModelPipe"
    assert math.isclose(res["pipe"], res["ref"], rel_tol=1e-6, abs_tol=1e-6), res
    assert math.isclose(res["pipe_with_mask"], res["ref"], rel_tol=1e-6, abs_tol=1e-6), res
    assert res["round_trip_keys_equal"] and res["round_trip_values_equal"] and res["layers_equal"]
    assert res["names"] == ["language_model.embedding.", "language_model.encoder.layers.0.",
                            "language_model.encoder.layers.1.", "language_model.encoder.layers.2.",
                            "language_model.encoder.final_layernorm.", None]


def test_mapping_rejects_wrong_layer_count() -> None:
    import torch

    from megatron.models.gpt.model_pipe import (
        megatron_state_dict_from_pipe_layers,
        pipe_layers_from_megatron_state_dict,
    )

    sd = {"language_model.embedding.word_embeddings.weight": torch.zeros(2, 2),
          "language_model.encoder.layers.0.input_layernorm.weight": torch.zeros(2),
          "language_model.encoder.layers.1.input_layernorm.weight": torch.zeros(2),
          "language_model.encoder.final_layernorm.weight": torch.zeros(2)}
    layers = pipe_layers_from_megatron_state_dict(sd, 2)
    assert sorted(layers) == [0, 1, 2, 3]
    assert megatron_state_dict_from_pipe_layers(layers, 2).keys() == sd.keys()
    with pytest.raises(ValueError, match="map to no pipe layer"):
        pipe_layers_from_megatron_state_dict(sd, 1)
    with pytest.raises(ValueError, match="missing for layer indices"):
        megatron_state_dict_from_pipe_layers({0: layers[0], 1: layers[1], 3: layers[3]}, 2)


@pytest.fixture(scope="module")
def serial(gpt_data: dict) -> dict:
    (res,) = run_distributed(run_pretrain_serial_init, 1, args=(tiny_gpt_argv(gpt_data),))
    assert res["error"] is None, res["error"]
    curve = parse_losses(res["stdout"])
    assert len(curve["train"]) == 20 and curve["train"][20] < curve["train"][1] - 0.2
    curve["grad_norm"] = _grad_norms(res["stdout"])
    assert max(curve["grad_norm"].values()) > 1.0, "--clip-grad 1.0 should be active in some steps"
    return curve


def _ds_argv(gpt_data: dict, config: str, *extra: str, iters: int = 20) -> list[str]:
    return tiny_gpt_argv(gpt_data, "--deepspeed", "--deepspeed_config", config, *extra, iters=iters)


def _run(world_size: int, argv: list[str]) -> list[dict]:
    results = run_distributed(run_pretrain_ds_serial_init, world_size, args=(argv,))
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    return results


def test_ds_pipe_pp2_matches_serial_and_resumes(serial: dict, gpt_data: dict, tmp_path: Path) -> None:
    config = write_ds_config(str(tmp_path / "ds.json"), zero_optimization={"stage": 0})
    extra = ["--pipeline-model-parallel-size", "2", "--save", str(tmp_path / "a"), "--save-interval", "10"]
    results = _run(2, _ds_argv(gpt_data, config, *extra))
    curve = parse_losses(results[-1]["stdout"])
    _assert_close(curve, serial, "DeepSpeed PP=2")
    assert [p for p, _ in curve["val"]] == [p for p, _ in serial["val"]] and serial["val"]
    for (p, a), (_, b) in zip(curve["val"], serial["val"]):
        assert math.isclose(a, b, rel_tol=REL), f"validation at {p}: {a} vs {b}"
    norms = _grad_norms(results[-1]["stdout"])
    assert sorted(norms) == sorted(serial["grad_norm"])
    for it, norm in serial["grad_norm"].items():
        assert math.isclose(norms[it], norm, rel_tol=1e-4), f"grad norm at {it}: {norms[it]} vs {norm}"

    # DeepSpeed's pipe checkpoint: one file per pipe layer (2 transformer layers -> 0..3; the tied head has none).
    step = tmp_path / "a" / "global_step10"
    files = sorted(f for f in os.listdir(step) if f.startswith("layer_"))
    assert files == [f"layer_{i:02d}-model_00-model_states.pt" for i in range(4)], files
    assert (tmp_path / "a" / "latest").read_text().strip() == "global_step20"

    (tmp_path / "a" / "latest").write_text("global_step10")
    resumed = _run(2, _ds_argv(gpt_data, config, "--pipeline-model-parallel-size", "2", "--load",
                               str(tmp_path / "a"), "--save", str(tmp_path / "b"), "--save-interval", "10"))
    again = parse_losses(resumed[-1]["stdout"])
    assert sorted(again["train"]) == list(range(11, 21))
    for it in range(11, 21):
        assert again["train"][it] == curve["train"][it], (it, curve["train"][it], again["train"][it])


def test_ds_pipe_tp2_pp2_zero1_matches_serial(serial: dict, gpt_data: dict, tmp_path: Path) -> None:
    config = write_ds_config(str(tmp_path / "ds.json"), zero_optimization={"stage": 1})
    results = _run(4, _ds_argv(gpt_data, config, "--pipeline-model-parallel-size", "2",
                               "--tensor-model-parallel-size", "2", "--checkpoint-activations"))
    curve = parse_losses(results[-1]["stdout"])
    _assert_close(curve, serial, "DeepSpeed TP=2 x PP=2 (ZeRO-1, activation checkpointing)")
    for (p, a), (_, b) in zip(curve["val"], serial["val"]):
        assert math.isclose(a, b, rel_tol=REL), f"validation at {p}: {a} vs {b}"
    norms = _grad_norms(results[-1]["stdout"])
    for it, norm in serial["grad_norm"].items():
        assert math.isclose(norms[it], norm, rel_tol=1e-4), f"grad norm at {it}: {norms[it]} vs {norm}"


def test_zero2_with_pipeline_refused_at_startup(gpt_data: dict, tmp_path: Path) -> None:
    config = write_ds_config(str(tmp_path / "ds.json"), zero_optimization=None)  # the stage comes from the flag
    argv = _ds_argv(gpt_data, config, "--pipeline-model-parallel-size", "2", "--zero-stage", "2")
    results = run_distributed(run_pretrain_ds, 2, args=(argv,))
    for r in results:
        assert r["error"] is not None and "\n" not in r["error"], r["error"]
        assert "ZeRO stage 2" in r["error"] and "pipeline" in r["error"], r["error"]
        assert "iteration" not in r["stdout"]


def test_unsupported_pipe_configs_fail_with_one_line() -> None:
    from megatron.core.parallel_state import ParallelState
    from megatron.core.transformer_config import TransformerConfig
    from megatron.models.gpt.model_pipe import PipeConfigError, _check_supported

    state = ParallelState(pp_size=2, tp_size=2)
    sp = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=2,
                           sequence_parallel=True)
    with pytest.raises(PipeConfigError, match=r"^--sequence-parallel is not supported with the DeepSpeed pipeline"):
        _check_supported(sp, state, 0)
    odd = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4)
    with pytest.raises(PipeConfigError, match=r"--num-layers \(3\) must be divisible by --pipeline-model-parallel"):
        _check_supported(odd, state, 0)
