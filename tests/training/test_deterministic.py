"""--deterministic-mode: the switches it sets, the flash-attention refusal, and two identical DP=2 pretrain_gpt runs
with dropout on giving bitwise-identical losses, grad norms and checkpoints."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.arguments import ArgumentError, parse_args, validate_args
from megatron.initialize import set_deterministic_mode
from tests.dist_utils import run_distributed
from tests.training._workers import run_pretrain, tiny_gpt_argv

LINE_RE = re.compile(r" iteration +(\d+)/.*?(lm loss: \S+ \|).*?(grad norm: \S+ \|)")


def _deterministic_run(rank: int, world_size: int, argv: list[str]) -> dict:
    out = run_pretrain(rank, world_size, argv)
    out["deterministic"] = torch.are_deterministic_algorithms_enabled()
    out["env"] = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO")}
    return out


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested checkpoint dict, keyed by its path."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        found[prefix] = obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            found.update(_tensors(value, f"{prefix}/{key}"))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found.update(_tensors(value, f"{prefix}/{i}"))
    return found


def test_switches_and_environment() -> None:
    env: dict[str, str] = {}
    try:
        set_deterministic_mode(env)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
        env = {"NCCL_ALGO": "Tree", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        set_deterministic_mode(env)
        assert env == {"NCCL_ALGO": "Tree", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}  # the user's choices are kept
        with pytest.raises(ArgumentError, match="NCCL_ALGO=NVLS"):
            set_deterministic_mode({"NCCL_ALGO": "NVLS"})
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


def test_flash_attention_is_refused() -> None:
    args = parse_args(args="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                           "--max-position-embeddings 64 --micro-batch-size 2 --train-iters 10 --lr 1e-3 "
                           "--use-flash-attn --deterministic-mode".split())
    args.world_size = 1
    with pytest.raises(ArgumentError, match="--deterministic-mode cannot be combined with --use-flash-attn"):
        validate_args(args)


def test_two_runs_are_bitwise_identical(gpt_data: dict, tmp_path: Path) -> None:
    runs = []
    for name in ("a", "b"):
        argv = tiny_gpt_argv(gpt_data, "--deterministic-mode", "--hidden-dropout", "0.1", "--attention-dropout",
                             "0.1", "--save", str(tmp_path / name), "--save-interval", "10", iters=10)
        results = run_distributed(_deterministic_run, 2, args=(argv,))
        assert all(r["error"] is None for r in results), [r["error"] for r in results]
        assert all(r["deterministic"] for r in results)
        assert results[0]["env"] == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
        assert "> deterministic mode: torch deterministic algorithms on" in results[0]["stdout"]
        runs.append(results[-1]["stdout"])
    lines = [LINE_RE.findall(out) for out in runs]
    assert len(lines[0]) == 10 and lines[0] == lines[1]
    vals = [re.findall(r"lm loss value: \S+ \| lm loss PPL: \S+", out) for out in runs]
    assert vals[0] and vals[0] == vals[1]
    sds = [torch.load(tmp_path / name / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
           for name in ("a", "b")]
    ta, tb = _tensors(sds[0]), _tensors(sds[1])
    assert ta.keys() == tb.keys()
    assert any(k.startswith("/model/") for k in ta) and any(k.startswith("/optimizer/") for k in ta)
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, different
    # Dropout is really on: the same run without dropout gives another curve.
    no_dropout = run_distributed(run_pretrain, 2, args=(tiny_gpt_argv(gpt_data, "--deterministic-mode", iters=3),))
    assert no_dropout[-1]["error"] is None, no_dropout[-1]["error"]
    other = LINE_RE.findall(no_dropout[-1]["stdout"])
    assert len(other) == 3 and other[1] != lines[0][1], (other, lines[0][:2])
