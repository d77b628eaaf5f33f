"""Module-level helpers for the DeepSpeed tests (they must pickle for `run_distributed`).

- `run_pretrain_ds(rank, world_size, argv)`: pretrain_gpt.main(argv) in-process with stdout captured, after setting
  the environment DeepSpeed reads (it is already set by tests.dist_utils; LOCAL_RANK/LOCAL_WORLD_SIZE/CROSS_* are
  filled in here). One-line user errors (MegatronUserError, SystemExit, RuntimeError, ValueError) come back as
  ``error`` instead of failing the worker.
- `write_ds_config(path, **overrides)`: write a small fp32 DeepSpeed JSON config (ZeRO stage 1 by default);
  nested dicts in ``overrides`` are merged one level deep (e.g. ``zero_optimization={"stage": 3}``).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
from typing import Any, Callable, Optional

from tests.training._workers import parse_losses, tiny_gpt_argv  # noqa: F401  (re-exported for DS tests)


def ds_env(rank: int, world_size: int) -> None:
    """Environment variables DeepSpeed expects from its launcher (keeps those already set)."""
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("CROSS_RANK", "0")
    os.environ.setdefault("CROSS_SIZE", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def run_pretrain_ds(rank: int, world_size: int, argv: list[str], model_provider: Optional[Callable] = None,
                    datasets_provider: Optional[Callable] = None) -> dict:
    """pretrain_gpt.py's pretrain() (tests/harness.py; optionally with another `model_provider` or
    `datasets_provider`) with DeepSpeed's env and stdout captured: {'stdout', 'result', 'error'}."""
    ds_env(rank, world_size)
    from megatron.errors import MegatronUserError
    from tests.harness import pretrain_run

    buf = io.StringIO()
    error = None
    result = None
    with contextlib.redirect_stdout(buf):
        try:
            result = pretrain_run(argv, model_provider=model_provider, datasets_provider=datasets_provider)
        except (MegatronUserError, RuntimeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        except SystemExit as exc:
            error = f"SystemExit: {exc.code}"
        finally:
            _reset_megatron()
    return {"stdout": buf.getvalue(), "result": result, "error": error}


def _reset_megatron() -> None:
    """Forget model-parallel state and globals so a second run can start in the same process."""
    try:
        from megatron.core import parallel_state
        from megatron.global_vars import unset_global_variables

        parallel_state.destroy_model_parallel()
        unset_global_variables()
    except Exception:  # noqa: BLE001 - best effort between runs
        pass


def write_ds_config(path: str, **overrides: Any) -> str:
    """Write a DeepSpeed JSON config (fp32, ZeRO-1, clipping 1.0 unless overridden); returns the path."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": 8,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    for key, value in overrides.items():
        if value is None:
            config.pop(key, None)
        elif isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return path
