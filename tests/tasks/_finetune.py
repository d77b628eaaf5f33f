"""Helpers of the finetuning tests: tasks/main.py (and pretrain_bert.py) runs in a gloo process with stdout captured,
every parallel layout starting from the serial model's weights (the full Classification built from the seed, its
slice copied into this rank's stage), and the flags of the tiny finetuning model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from pathlib import Path
from typing import Any, Optional

import torch

LAYERS, HIDDEN, HEADS, SEQ = 2, 32, 4, 64


def task_argv(vocab: str, *extra: str, hidden: int = HIDDEN) -> list[str]:
    return ["--num-layers", str(LAYERS), "--hidden-size", str(hidden), "--num-attention-heads", str(HEADS),
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-file", vocab,
            "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "1", "--distributed-backend", "gloo",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--no-bias-gelu-fusion",
            "--eval-iters", "1", "--eval-interval", "1000",
            "--make-vocab-size-divisible-by", "256", *extra]  # the same padded vocabulary at TP 1 and 2


def _serial_model(args: Any, config: Any, state: Any, num_classes: int) -> torch.nn.Module:
    """The full (unsplit) Classification, or MultipleChoice when num_classes is 0, built from the run's seed."""
    from megatron.core.tensor_parallel import get_rng_tracker
    from megatron.core.tensor_parallel.random import model_parallel_manual_seed
    from megatron.models.bert.classification import Classification
    from megatron.models.bert.multiple_choice import MultipleChoice

    config = dataclasses.replace(config, pipeline_model_parallel_size=1)
    tracker = get_rng_tracker().get_states()
    with torch.random.fork_rng(devices=[]):
        model_parallel_manual_seed(args.seed, state.tp_rank)
        torch.manual_seed(args.seed)
        full = (Classification(config, num_classes, tp_group=state.tp_group) if num_classes
                else MultipleChoice(config, tp_group=state.tp_group))
    get_rng_tracker().set_states(tracker)
    return full


def _serial_init(task: Any, args: Any, num_classes: int) -> Any:
    from megatron.core import parallel_state as ps
    from tests.pipeline._workers import _copy_stage_weights

    provider = task.model_provider

    def model_provider(config: Any, pre_process: bool = True, post_process: bool = True) -> Any:
        state = ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()
        stage = provider(config, pre_process=pre_process, post_process=post_process)
        _copy_stage_weights(_serial_model(args, config, state, num_classes), stage)
        return stage

    task.model_provider = model_provider
    return task


def _patch_serial_init() -> Any:
    import tasks.glue.finetune as glue
    import tasks.race.finetune as race

    glue_base, race_base = glue.glue_task, race.race_task
    glue.glue_task = lambda name, args: _serial_init(glue_base(name, args), args, glue._TASKS[name][0].NUM_CLASSES)
    race.race_task = lambda args: _serial_init(race_base(args), args, 0)

    def restore() -> None:
        glue.glue_task, race.race_task = glue_base, race_base

    return restore


def run_one(rank: int, world_size: int, entry: str, argv: list[str], resume_from: Optional[tuple[str, int]] = None,
            serial_init: bool = False) -> dict:
    """`entry` ('tasks' or 'pretrain_bert') main(argv) here; {'stdout', 'result', 'error'}."""
    from megatron.errors import MegatronUserError
    from tests.ds._workers import _reset_megatron, ds_env

    ds_env(rank, world_size)
    if resume_from is not None:
        if rank == 0:
            Path(resume_from[0], "latest_checkpointed_iteration.txt").write_text(str(resume_from[1]))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    restore = _patch_serial_init() if serial_init else (lambda: None)
    buf, error, result = io.StringIO(), None, None
    with contextlib.redirect_stdout(buf):
        try:
            if entry == "pretrain_bert":
                import pretrain_bert

                result = pretrain_bert.main(argv)
            else:
                from tasks.main import main

                result = main(argv)
        except (MegatronUserError, RuntimeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            restore()
            _reset_megatron()
    return {"stdout": buf.getvalue(), "result": result, "error": error}


def run_many(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """Several runs (run_one keyword dicts) one after another in one process group."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return [run_one(rank, world_size, **run) for run in runs]


def ok(res: dict, what: str) -> dict:
    assert res["error"] is None, f"{what}: {res['error']}\n{res['stdout'][-3000:]}"
    return res
