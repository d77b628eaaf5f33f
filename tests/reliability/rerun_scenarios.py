"""Scripted scenarios for a rerun state machine, driven the same way against ours (in-process) and megatron-core
0.16.1's (in the oracle subprocess): this file imports neither `megatron`, it gets the machine's module through an
adapter (`api`). test_rerun_oracle.py compares the records step by step.

A step reads 2 micro-batches; each run of its forward-backward makes one loss per micro-batch from the sample and a
torch random draw (which a re-run must repeat), validates it as Megatron's loss checks do (NaN and Inf fatal, spiky
not fatal) and the step's "grad norm" as its large-grads check does. A scenario corrupts chosen (iteration, attempt,
micro-batch) values; attempts are counted per iteration over the jobs, so a corruption can persist into the job
resumed from the checkpoint. A job ends at the machine's exit request; one that asks for a checkpoint is followed by a
job resumed from that checkpoint's machine state, RNG state and data position, on the scenario's next device.
"""
from __future__ import annotations

import functools
import math
import pickle
import random
import re
from typing import Any, Optional

import numpy as np
import torch

NAN_MSG = "found NaN in local forward loss calculation"
INF_MSG = "found Inf in local forward loss calculation"
SPIKY_MSG = "Spiky loss"
GRADS_MSG = "found unexpected large grads in backward pass before data-parallel communication collective"
MICRO_BATCHES = 2
RESUME = 16  # the exit code asking to resume from the checkpoint just saved
CORRUPTIONS = {"nan": float("nan"), "inf": float("inf"), "spike": 1000.0}

# name -> spec: mode, iterations, checks, corrupt {"iteration:attempt:mb" (mb "g": the grad norm): kind}, devices (one
# per job), injection (rate, type), drift (added per attempt: non-deterministic results), samples (of the 10x rule)
SCENARIOS: dict[str, dict] = {
    "clean": dict(checks=("nan", "inf", "spiky", "grads")),
    "transient_nan": dict(checks=("nan", "inf"), corrupt={"2:0:1": "nan"}),
    "transient_inf_in_first_step": dict(checks=("nan", "inf"), corrupt={"0:0:0": "inf"}),
    "persistent_nan": dict(checks=("nan", "inf"), corrupt={"2:0:0": "nan", "2:1:0": "nan"}),
    "persistent_nan_correct": dict(checks=("nan", "inf"), corrupt={"2:0:0": "nan", "2:1:0": "nan", "2:2:0": "nan"}),
    "persistent_nan_same_device": dict(checks=("nan", "inf"), corrupt={"2:0:0": "nan", "2:1:0": "nan"},
                                       devices=(0, 0, 1)),
    "spiky_transient": dict(checks=("nan", "spiky"), corrupt={"4:0:1": "spike"}),
    "spiky_persistent": dict(checks=("nan", "spiky"), corrupt={"4:0:0": "spike", "4:1:0": "spike"}),
    "large_grads": dict(checks=("nan", "grads"), corrupt={"4:0:g": "spike", "6:0:g": "spike", "6:1:g": "spike"}),
    "injected_transient": dict(checks=("spiky",), injection=(3, "transient_error"), iterations=10),
    "injected_persistent": dict(checks=("nan",), injection=(2, "persistent_error")),
    "injected_correct": dict(checks=("nan",), injection=(2, "correct_result")),
    "disabled_nan": dict(mode="disabled", checks=("grads", "nan"), corrupt={"2:0:1": "nan", "1:0:g": "spike"}),
    "stats_deterministic": dict(mode="report_determinism_stats", checks=("nan", "grads"), iterations=4),
    "stats_nondeterministic": dict(mode="report_determinism_stats", checks=("nan", "grads"), iterations=4,
                                   drift=1e-3),
}


def shown(x: Any) -> Any:
    """A JSON-able, exactly comparable form of a result (NaN compares equal to NaN)."""
    if isinstance(x, torch.Tensor):
        x = float(x)
    if isinstance(x, float):
        return repr(x) if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {str(k): shown(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [shown(v) for v in x]
    return x


def _corrupt(spec: dict, key: str, value: torch.Tensor) -> torch.Tensor:
    kind = spec.get("corrupt", {}).get(key)
    return value if kind is None else value * CORRUPTIONS[kind]


def _validate(machine: Any, spec: dict, loss: torch.Tensor) -> None:
    checks = spec["checks"]
    if "nan" in checks:
        machine.validate_result(loss, torch.isnan, NAN_MSG, tolerance=0.0, fatal=True)
    if "inf" in checks:
        machine.validate_result(loss, torch.isinf, INF_MSG, tolerance=0.0, fatal=True)
    if "spiky" in checks:
        large = functools.partial(machine.is_unexpectedly_large, threshold=10, context="loss",
                                  num_samples=spec.get("samples", 3))
        machine.validate_result(loss, large, SPIKY_MSG, tolerance=0.0, fatal=False)


def run_step(machine: Any, spec: dict, data: Any, iteration: int, attempts: dict) -> dict:
    """One step as a training loop drives it; what the machine answered and did."""
    answers, runs, error = [], [], None
    try:
        while True:
            go = bool(machine.should_run_forward_backward(data))
            answers.append(go)
            if not go:
                break
            attempt = attempts[iteration] = attempts.get(iteration, -1) + 1
            losses = []
            for mb in range(MICRO_BATCHES):
                loss = torch.tensor(1.0 + 0.001 * next(data)) + 0.01 * torch.rand(()) + spec.get("drift", 0) * attempt
                loss = _corrupt(spec, f"{iteration}:{attempt}:{mb}", loss)
                _validate(machine, spec, loss)
                losses.append(loss)
            if "grads" in spec["checks"]:
                norm = _corrupt(spec, f"{iteration}:{attempt}:g", sum(losses) * 0.5 + 0.01 * torch.rand(()))
                large = functools.partial(machine.is_unexpectedly_large, threshold=10, context="grads",
                                          num_samples=spec.get("samples", 3))
                machine.validate_result(norm, large, GRADS_MSG, tolerance=0.001, fatal=False)
            runs.append(shown(losses))
    except Exception as exc:  # Megatron's disabled mode raises on a fatal rejection
        error = f"{type(exc).__name__}: {exc}"
    exit_request = [] if error else list(machine.should_checkpoint_and_exit())
    return {"iteration": machine.current_iteration, "answers": answers, "runs": runs, "exit": exit_request,
            "error": error, "state": machine.state.value, "counts": dict(machine.large_value_counts),
            "max_values": shown(machine.max_values)}


def _stats(api: Any, machine: Any) -> dict:
    return {message: [s.zero_cnt, shown(sorted(s.samples)), shown(s.max), s.print_stats()]
            for message, s in sorted(api.stats(machine).items())}


def run_job(api: Any, spec: dict, machine: Any, first: int, attempts: dict) -> dict:
    """Steps from iteration `first` until the machine asks to exit (or the scenario's last iteration)."""
    data = api.mod.RerunDataIterator(iter(range(MICRO_BATCHES * first, 10**6)))
    steps, saved = [], None
    for iteration in range(first, spec.get("iterations", 7)):
        step = run_step(machine, spec, data, iteration, attempts)
        if spec.get("mode") == "report_determinism_stats":
            step["stats"] = _stats(api, machine)
        step["log"] = api.take_log()  # the machine's log lines since the previous step (its creation, loading, step)
        steps.append(step)
        if step["error"] or step["exit"][1]:
            if step["exit"] and step["exit"][0]:
                saved = {"machine": api.save(machine, data), "iteration": iteration,
                         "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state())}
            break
    return {"steps": steps, "saved": saved}


def tracker_lines(path: str) -> list[str]:
    """The tracker file's lines without their time stamps."""
    with open(path) as f:
        return [re.sub(r"^ts=.*? node=", "node=", line.rstrip("\n")) for line in f]


def run_scenario(api: Any, name: str, tracker: str, load_from: Optional[str] = None) -> dict:
    """The scenario's jobs (each resumed from the previous one's checkpoint; the second one from the machine state
    pickled in `load_from` instead, when given) and the tracker file they wrote."""
    spec = dict(SCENARIOS[name])
    spec.setdefault("mode", "validate_results")
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    rate, kind = spec.get("injection", (0, "transient_error"))
    devices, attempts, jobs, first, state = list(spec.get("devices", (0, 1))), {}, [], 0, None
    api.take_log()  # what came before (a previous scenario's reading of its tracker)
    for device in devices:
        api.set_device(device)
        machine = api.make(spec["mode"], tracker, rate, kind)
        if state is not None:
            machine_state = state["machine"]
            if load_from is not None and len(jobs) == 1:
                with open(load_from, "rb") as f:
                    machine_state = pickle.load(f)
            api.load(machine, machine_state)
            torch.set_rng_state(state["rng"][0])
            random.setstate(state["rng"][1])
            np.random.set_state(state["rng"][2])
        job = run_job(api, spec, machine, first, attempts)
        jobs.append(job)
        last = job["steps"][-1]["exit"] if job["steps"] else []
        if not (last and last[1] and last[2] == RESUME):
            break  # ran to the end, raised, or failed (17)
        if job["saved"] is not None:  # else: resume again from the same checkpoint
            state, first = job["saved"], job["saved"]["iteration"]
    return {"jobs": [{"steps": j["steps"], "saved": None if j["saved"] is None else shown_state(j["saved"]["machine"])}
                     for j in jobs], "tracker": tracker_lines(tracker), "skipped": api.skipped(tracker),
            "raw_saved": [None if j["saved"] is None else j["saved"]["machine"] for j in jobs]}


def shown_state(sd: Optional[dict]) -> Any:
    """A checkpoint entry in JSON-able form (tuples as lists, tensors and NaN as in `shown`)."""
    return None if sd is None else shown(sd)
