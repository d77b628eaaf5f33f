"""Module-level worker functions for `run_distributed` (they must pickle): run pretrain_gpt in-process."""
from __future__ import annotations

import contextlib
import io
import os
import signal
from pathlib import Path
from typing import Any, Callable, Optional

from megatron.presets import get_preset
from tests.log_lines import parse_losses  # noqa: F401  (re-exported: the tests' old import path)


def tiny_gpt_argv(data: dict, *extra: str, iters: int = 20) -> list[str]:
    """The tiny GPT of the golden curves (preset gpt_test: 2 layers, hidden 64, 4 heads, seq 64), fp32, no dropout."""
    return [
        *get_preset("gpt_test").argv(),
        "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(iters),
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--vocab-file", data["vocab"], "--merge-file", data["merges"], "--data-path", data["prefix"],
        "--split", "98,2,0", "--log-interval", "1", "--eval-interval", "10", "--eval-iters", "2",
        "--num-workers", "0", "--seed", "1234", *extra,
    ]


def checkpoint_at(ckpt: Path, iteration: int, tmp_path: Path) -> Path:
    """A --load folder holding only `iteration` of `ckpt` (which saved later ones too)."""
    out = tmp_path / f"{ckpt.name}_at{iteration}"
    out.mkdir()
    (out / f"iter_{iteration:07d}").symlink_to(ckpt / f"iter_{iteration:07d}")
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return out


def curve_from_result(result: dict) -> dict[str, Any]:
    """The same {'train', 'val'} curve from the numbers pretrain() returns (full precision, no log parsing)."""
    train = {it: losses["lm loss"] for it, losses in result["train_losses"].items() if losses}
    val = [(f"iteration {it}", losses["lm loss"]) for it, losses in sorted(result["valid_losses"].items())]
    if result.get("val_loss"):
        val.append(("the end of training for val data", result["val_loss"]["lm loss"]))
    return {"train": train, "val": val}


def run_pretrain(rank: int, world_size: int, argv: list[str], sigterm_at_call: Optional[int] = None,
                 model_provider: Optional[Callable] = None) -> dict:
    """pretrain_gpt.py's pretrain() (tests/harness.py) with stdout captured; optionally SIGTERM this process at a
    forward-step call, or with another `model_provider`."""
    from tests.harness import entry_providers, pretrain_run

    forward_step = None
    if sigterm_at_call is not None and rank == 0:
        calls = {"n": 0}
        original = entry_providers("pretrain_gpt").forward_step

        def forward_step(data_iterator, model):
            calls["n"] += 1
            if calls["n"] == sigterm_at_call:
                os.kill(os.getpid(), signal.SIGTERM)
            return original(data_iterator, model)

    buf = io.StringIO()
    error = None
    with contextlib.redirect_stdout(buf):
        try:
            result = pretrain_run(argv, model_provider=model_provider, forward_step=forward_step)
        except (RuntimeError, ValueError) as exc:  # surfaced to the test as a one-line message
            result, error = None, f"{type(exc).__name__}: {exc}"
    return {"stdout": buf.getvalue(), "result": result, "error": error}
