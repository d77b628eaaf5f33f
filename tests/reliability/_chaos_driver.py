"""Crash-test driver: ``python -m tests.reliability._chaos_driver plan.json result.json``.

Imports pretrain_gpt and torch._dynamo once (no torch compute in this process, one OpenMP thread, so forking is safe)
and then, for each run of the plan in order, forks a child that runs its pretrain() (tests/harness.py) with ``MEGATRON_FAULT_INJECT`` set to the
run's fault spec (the child SIGKILLs itself there; ``forward-step`` points fire at every forward step). Before each run
it records which iteration a correct loader must resume from (the newest iteration at or below the tracker whose
files match their manifest); after it, the run's exit status, stdout and the temp files left in the save folder.
"""
from __future__ import annotations

import json
import os
import sys


def _expected_resume(save: str) -> int | None:
    from megatron.checkpoint import integrity

    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return None
    top = int(open(tracker).read().strip())
    for it in [top] + [i for i in integrity.iterations(save) if i < top]:
        if integrity.verify(integrity.iteration_dir(save, it)) is None:
            return it
    return -1


def _child(argv: list[str], fault: str | None, out_path: str) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if fault:
        os.environ["MEGATRON_FAULT_INJECT"] = fault
    from megatron.checkpoint.atomic_io import fault_point
    from megatron.errors import MegatronUserError
    from tests.harness import entry_providers, pretrain_run

    original = entry_providers("pretrain_gpt").forward_step

    def forward_step(data_iterator, model):
        fault_point("forward-step")
        return original(data_iterator, model)

    code = 0
    try:
        pretrain_run(argv, forward_step=forward_step)
    except MegatronUserError as exc:
        print(f"error: {exc}", flush=True)
        code = 1
    sys.stdout.flush()
    os._exit(code)


def main() -> None:
    plan = json.load(open(sys.argv[1]))
    import torch._dynamo  # noqa: F401  (a torch optimizer imports it at its first parameter group: ~1.7 CPU s, once)

    import tests.harness  # noqa: F401  (imported once, before forking)
    tests.harness.entry_providers("pretrain_gpt")
    from megatron.checkpoint.atomic_io import is_temp_file

    results = []
    for i, entry in enumerate(plan["runs"]):
        save = entry["save"]
        expected = _expected_resume(save)
        out_path = os.path.join(plan["work"], f"run{i:02d}.log")
        pid = os.fork()
        if pid == 0:
            _child(entry["argv"], entry.get("fault"), out_path)
        _, status = os.waitpid(pid, 0)
        temps = [os.path.join(d, n) for d, _, names in os.walk(save) for n in names if is_temp_file(n)]
        results.append({"fault": entry.get("fault"), "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
                        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                        "expected_resume": expected, "stdout": open(out_path).read(), "temps": temps})
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
