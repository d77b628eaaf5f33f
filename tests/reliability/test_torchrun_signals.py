"""Signals under torchrun (issue 44 item 3 and its weak item): a scheduler's SIGTERM under --exit-signal-handler with
the default data-loader workers saves and every rank exits 0, whether it reaches torchrun alone, torchrun's process
group (os.killpg) or every process of the job (what `scancel` does); a `kill -9` of torchrun's agent ends its
workers at once, with no checkpoint written after it. And the data-loader workers themselves: a SIGTERM or SIGINT from
anyone but their trainer leaves them working, their trainer's own SIGTERM still stops them.

Two ranks of the tiny GPT on gloo, started by `python -m torch.distributed.run` (plain torchrun) and by
`python -m megatron.quiet_torchrun` (the example scripts' torchrun); each rank runs under a bash wrapper that records
the rank's own exit code (plain torchrun reports no worker exit codes when it is signalled)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron.checkpoint import integrity
from megatron.compat import load_state_dict_file
from megatron.data.data_samplers import build_pretraining_data_loader
from megatron.initialize import find_free_port
from tests.reliability.helpers import REPO, train_argv

# Every rank's exit code in OUT/rc.<RANK>; bash's TERM trap only keeps bash alive until the rank has finished.
WRAPPER = 'trap ":" TERM; "$0" -m tests.reliability._rank_worker "$@"; rc=$?; echo $rc > "$1/rc.$RANK"; exit $rc'


def _argv(data: dict, ckpt: Path, *extra: str) -> list[str]:
    """The tiny GPT for many iterations, with the default --num-workers (2 data-loader workers per rank)."""
    argv = train_argv(data, "--global-batch-size", "4", "--distributed-backend", "gloo", "--save", str(ckpt),
                      "--save-interval", "1000", *extra, iters=5000)
    at = argv.index("--num-workers")
    return argv[:at] + argv[at + 2:]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC", "MEGATRON_FAULT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("REL_FAULT", None)
    return env


def _launch(launcher: str, out: Path, argv: list[str], wrapped: bool = True) -> subprocess.Popen:
    """Start `python -m <launcher>` with 2 ranks in a session of its own (a job's process group)."""
    out.mkdir(parents=True, exist_ok=True)
    entry = ["--no-python", "bash", "-c", WRAPPER, sys.executable] if wrapped else ["-m", "tests.reliability._rank_worker"]
    cmd = [sys.executable, "-m", launcher, "--nproc-per-node", "2", "--master-port", str(find_free_port()),
           "--monitor-interval", "0.1", *entry, str(out), *argv]
    logs = [open(out / name, "w") for name in ("launcher.out", "launcher.err")]
    return subprocess.Popen(cmd, cwd=out, env=_env(), stdout=logs[0], stderr=logs[1], start_new_session=True)


def _wait_for_iteration(proc: subprocess.Popen, out: Path, iteration: int) -> None:
    """Poll the launcher's log until rank 0 logged `iteration` (bounded)."""
    deadline = time.time() + 240
    while f" iteration {iteration:8d}/" not in (out / "launcher.out").read_text():
        assert proc.poll() is None and time.time() < deadline, (out / "launcher.err").read_text()[-3000:]
        time.sleep(0.1)  # polling a log file for progress


def _children() -> dict[int, list[int]]:
    """parent pid -> its live child pids (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and _alive(int(name)):
            try:
                ppid = int((Path("/proc") / name / "stat").read_text().rpartition(")")[2].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(name))
    return children


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid`."""
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after `seconds` (polled)."""
    deadline = time.time() + seconds
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)  # polling process exits
    return [p for p in pids if _alive(p)]


def _assert_saved_on_sigterm(out: Path, ckpt: Path) -> int:
    """Every rank exited 0 after pretrain returned at the same iteration; that iteration is the verified, loadable
    latest checkpoint. Returns it."""
    codes = {rank: (out / f"rc.{rank}").read_text().strip() for rank in range(2)}
    assert codes == {0: "0", 1: "0"}, (codes, (out / "launcher.err").read_text()[-3000:])
    results = [json.loads((out / f"rank{rank}.attempt0.json").read_text()) for rank in range(2)]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert [r["iteration"] for r in results] == [saved, saved] and saved >= 3
    assert integrity.verify(str(integrity.iteration_dir(str(ckpt), saved))) is None
    state = load_state_dict_file(str(integrity.iteration_dir(str(ckpt), saved) + "/mp_rank_00/model_optim_rng.pt"))
    assert state["iteration"] == saved and state["model"]
    assert "exiting program after receiving SIGTERM" in (out / "launcher.out").read_text()
    assert "DataLoader worker" not in (out / "launcher.err").read_text()
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("launcher, target", [("torch.distributed.run", "torchrun"),
                                              ("torch.distributed.run", "group"),
                                              ("megatron.quiet_torchrun", "group"),
                                              ("megatron.quiet_torchrun", "every process")])
def test_sigterm_under_torchrun_saves_and_every_rank_exits_zero(tiny_data: dict, tmp_path: Path, launcher: str,
                                                                target: str) -> None:
    ckpt = tmp_path / "ckpt"
    proc = _launch(launcher, tmp_path, _argv(tiny_data, ckpt, "--exit-signal-handler"))
    try:
        _wait_for_iteration(proc, tmp_path, 3)
        if target == "torchrun":
            proc.send_signal(signal.SIGTERM)
        elif target == "group":
            os.killpg(proc.pid, signal.SIGTERM)  # the workers lead sessions of their own: the agent forwards it
        else:  # scancel: the launcher, the ranks, their bash wrappers and data-loader workers at once
            for pid in [proc.pid, *_descendants(proc.pid)]:
                os.kill(pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _assert_saved_on_sigterm(tmp_path, ckpt)
    if launcher == "megatron.quiet_torchrun":
        assert rc == 0 and not (tmp_path / "launcher.err").read_text().strip()
    else:  # torch elastic re-raises the signal after its workers stopped: not ours to change (docs/reliability.md)
        assert rc == 1 and "SignalException" in (tmp_path / "launcher.err").read_text()


@pytest.mark.slow
def test_quiet_torchrun_sigterm_without_the_handler_names_the_exit_codes(tiny_data: dict, tmp_path: Path) -> None:
    proc = _launch("megatron.quiet_torchrun", tmp_path, _argv(tiny_data, tmp_path / "ckpt"), wrapped=False)
    try:
        _wait_for_iteration(proc, tmp_path, 2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = (tmp_path / "launcher.err").read_text().splitlines()
    assert rc == 143 and len(err) == 1, err
    assert err[0].startswith("error: SIGTERM forwarded to the 2 workers of this node; exit codes {")
    assert "pass --exit-signal-handler to save and exit 0" in err[0]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_kill9_of_the_torchrun_agent_ends_its_workers(tiny_data: dict, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = _launch("torch.distributed.run", tmp_path, _argv(tiny_data, ckpt, "--save-interval", "2"), wrapped=False)
    try:
        _wait_for_iteration(proc, tmp_path, 3)
        ranks, everything = _children().get(proc.pid, []), _descendants(proc.pid)
        assert len(ranks) == 2 and len(everything) >= 6, everything  # 2 ranks x (1 + 2 data-loader workers)
        proc.kill()
        proc.wait()
        saved = sorted(p.name for p in ckpt.iterdir())
        assert _wait_gone(ranks, 3) == []  # the ranks die with their agent
        assert _wait_gone(everything, 10) == []  # their data-loader workers follow (torch's watchdog, 5 s)
    finally:
        for pid in _descendants(proc.pid) if proc.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
    assert sorted(p.name for p in ckpt.iterdir()) == saved and "iter_0000002" in saved


@pytest.mark.slow
def test_dataloader_workers_leave_sigterm_and_sigint_to_the_trainer() -> None:
    dataset = [{"text": torch.tensor([i])} for i in range(64)]
    loader = build_pretraining_data_loader(dataset, 0, 2, 0, 1, num_workers=2)
    it = iter(loader)
    # two batches: one from each worker, so both have run their worker_init_fn (a signal that arrives between a
    # worker's start and its init still stops it: docs/reliability.md)
    first = next(it)["text"].flatten().tolist() + next(it)["text"].flatten().tolist()
    workers = [w.pid for w in it._workers]
    for sig in ("TERM", "INT"):  # from another process, as a scheduler or a terminal sends them
        subprocess.run(["kill", f"-{sig}", *map(str, workers)], check=True)
    rest = [x for batch in it for x in batch["text"].flatten().tolist()]  # the bug: "DataLoader worker (pid ...)
    assert first + rest == list(range(64))  # is killed by signal: Terminated"
    it = iter(loader)
    next(it)
    worker = it._workers[0]
    os.kill(worker.pid, signal.SIGTERM)  # the trainer's own SIGTERM (how torch stops a worker that lingers)
    worker.join(timeout=10)
    assert worker.exitcode == 0
