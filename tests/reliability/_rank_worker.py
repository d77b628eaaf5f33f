"""One rank of the dead-rank tests: ``python -m tests.reliability._rank_worker OUT_DIR pretrain_gpt flags...``.

Runs pretrain_gpt.py's pretrain() (tests/harness.py) as the entry script does (exit_on_user_error: one `error:` line), started directly with
RANK/WORLD_SIZE/MASTER_* in the environment (as srun or each node's torchrun starts a worker) or by torchrun.
``REL_FAULT="<rank> <point> <n> <action>"`` makes that rank act at the n-th matching point of the first attempt
(TORCHELASTIC_RESTART_COUNT unset or 0): points ``train-forward`` and ``eval-forward`` (the forward step in training
and in evaluation mode), or any megatron/checkpoint/atomic_io.py fault point such as ``mid-write:model_optim_rng.pt``; actions
``kill`` (SIGKILL), ``term`` (SIGTERM, SLURM's preemption signal), ``stop`` (SIGSTOP: a hung rank), ``raise`` (a
RuntimeError in the step). Just before
acting it writes OUT_DIR/fault.json with the time and pretrain's numbers so far. A run that returns writes its result
(pretrain's numbers) to OUT_DIR/rank<R>.attempt<A>.json. ``REL_SLOW="<rank> <n> <seconds>"`` makes that rank sleep
`seconds` in every training forward step from its n-th on (a straggler).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time


def main() -> None:
    out_dir, argv = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fault = os.environ.get("REL_FAULT", "").split()
    armed = bool(fault) and int(fault[0]) == rank and attempt == 0
    from megatron.errors import exit_on_user_error
    from tests.harness import entry_providers, pretrain_run

    history: dict = {}  # pretrain's result, filled as the run goes: the losses so far when the fault fires
    forward_step = None

    def fire() -> None:
        with open(os.path.join(out_dir, "fault.json"), "w") as f:
            json.dump({"rank": rank, "time": time.time(), "result": history}, f)
        if fault[3] == "raise":  # an exception in the step (--inprocess-restart restarts the run)
            raise RuntimeError(f"injected fault at {fault[1]} {fault[2]}")
        os.kill(os.getpid(), {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}[fault[3]])

    if armed and fault[1] in ("train-forward", "eval-forward"):
        original, hits = entry_providers("pretrain_gpt").forward_step, {"n": 0}

        def forward_step(data_iterator, model):
            if (fault[1] == "train-forward") == model.training:
                hits["n"] += 1
                if hits["n"] == int(fault[2]):
                    fire()
            return original(data_iterator, model)

    elif armed:  # a point of the atomic writer (its module-level calls look fault_point up at call time)
        from megatron.checkpoint import atomic_io

        original_point, hits = atomic_io.fault_point, {"n": 0}

        def fault_point(name: str) -> None:
            if fault[1] in name:
                hits["n"] += 1
                if hits["n"] == int(fault[2]):
                    fire()
            original_point(name)

        atomic_io.fault_point = fault_point
        os.environ[atomic_io.FAULT_LOG_ENV] = os.devnull  # makes the writer stop at `mid-write` with half the bytes
    slow = os.environ.get("REL_SLOW", "").split()
    if slow and int(slow[0]) == rank:
        inner, seen = forward_step or entry_providers("pretrain_gpt").forward_step, {"n": 0}

        def forward_step(data_iterator, model):  # noqa: F811  (the slowed step wraps the one above)
            if model.training:
                seen["n"] += 1
                if seen["n"] >= int(slow[1]):
                    time.sleep(float(slow[2]))
            return inner(data_iterator, model)

    result = exit_on_user_error(pretrain_run, argv, forward_step=forward_step, history=history)
    with open(os.path.join(out_dir, f"rank{rank}.attempt{attempt}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
