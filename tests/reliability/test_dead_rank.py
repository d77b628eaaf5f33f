"""A dead rank must not hang the job. Four gloo processes of the tiny GPT; one of them is killed (SIGKILL, at a
deterministic point: a training forward step, half-way through writing its checkpoint file, an evaluation forward
step). The three others must exit with code 1 and one `error:` line naming the dead rank, well within the
(short, test-only) distributed time-out, never hang; the last good checkpoint stays the loadable latest one. Under
`torchrun --max-restarts 1` the restarted job resumes from that checkpoint and continues the curve exactly, and under
--exit-signal-handler a SIGTERM (SLURM preemption) at one rank saves and exits 0 at the next step on every rank.

The workers are started as srun (or each node's torchrun) starts them: RANK/WORLD_SIZE/MASTER_* in the
environment, nobody to kill the survivors for them. Losses are compared as the numbers `pretrain` returned."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from megatron.checkpoint import integrity
from megatron.initialize import find_free_port
from tests.reliability.helpers import REPO, train_argv

TIMEOUT_S = 60  # MEGATRON_DISTRIBUTED_TIMEOUT_SECONDS: the survivors must exit well before it
DP4 = ["--global-batch-size", "8", "--distributed-backend", "gloo"]
TP2 = ["--tensor-model-parallel-size", "2", "--global-batch-size", "4", "--distributed-backend", "gloo"]


def _env(fault: Optional[str], timeout_s: int = TIMEOUT_S) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MEGATRON_FAULT"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MEGATRON_DISTRIBUTED_TIMEOUT_SECONDS":
                str(timeout_s), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "WORLD_SIZE": "4"})
    env.pop("REL_FAULT", None)
    if fault:
        env["REL_FAULT"] = fault
    return env


def _run4(argv: list[str], out: Path, fault: Optional[str], timeout_s: int = TIMEOUT_S, hung: Optional[int] = None
          ) -> tuple[list[subprocess.Popen], list[float]]:
    """Start 4 workers directly; wait for all but the `hung` one (bounded; that one is then killed); return them and
    each one's exit time."""
    out.mkdir(parents=True, exist_ok=True)
    env = _env(fault, timeout_s)
    procs = []
    for rank in range(4):
        logs = [open(out / f"rank{rank}.{kind}", "w") for kind in ("out", "err")]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.reliability._rank_worker", str(out), *argv], cwd=out,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=logs[0], stderr=logs[1]))
    ended = [0.0] * 4
    if hung is not None:
        ended[hung] = -1.0
    deadline = time.time() + 300
    try:
        while not all(ended) and time.time() < deadline:
            for rank, proc in enumerate(procs):
                if not ended[rank] and proc.poll() is not None:
                    ended[rank] = time.time()
            time.sleep(0.05)  # polling the exit of 4 processes (not a wait for something to happen)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(ended), "a rank hung: killed after 300 s"
    return procs, ended


def _assert_survivors_name(out: Path, procs: list, ended: list[float], dead: int, phase: str,
                           how: Optional[str] = None, bound_s: float = TIMEOUT_S) -> None:
    fault = json.loads((out / "fault.json").read_text())
    assert fault["rank"] == dead and procs[dead].returncode == -9  # killed by the fault, or by _run4 when hung
    for rank, proc in enumerate(procs):
        if rank == dead:
            continue
        err = (out / f"rank{rank}.err").read_text()
        assert proc.returncode == 1, (rank, proc.returncode, err[-3000:])
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert f"rank {rank} of 4 stopped during {phase}" in errors[0], errors[0]
        assert (how or f"rank {dead} died (process {procs[dead].pid} ") in errors[0], errors[0]
        assert ended[rank] - fault["time"] < bound_s, (rank, ended[rank] - fault["time"])


@pytest.mark.slow
def test_rank_killed_mid_step_others_exit_naming_it(tiny_data: dict, tmp_path: Path) -> None:
    argv = train_argv(tiny_data, *DP4, iters=8)
    procs, ended = _run4(argv, tmp_path, "2 train-forward 3 kill")
    _assert_survivors_name(tmp_path, procs, ended, 2, "training iteration 3")


@pytest.mark.slow
def test_hung_rank_times_out_in_a_tensor_parallel_group(tiny_data: dict, tmp_path: Path) -> None:
    """SIGSTOP rank 2 in step 2 of TP=2 x DP=2: rank 3 waits in its TP group's all-reduce, ranks 0-1 in the DP one;
    all three fail at the (test-short) time-out, which therefore reaches the model-parallel groups (torch's default
    for them is 30 minutes), and name rank 2 as not responding."""
    timeout_s = 20
    argv = train_argv(tiny_data, *TP2, iters=4)
    procs, ended = _run4(argv, tmp_path, "2 train-forward 2 stop", timeout_s, hung=2)
    _assert_survivors_name(tmp_path, procs, ended, 2, "training iteration 2",
                           f"rank 2 stopped responding (process {procs[2].pid} ", bound_s=timeout_s + 20)


@pytest.mark.slow
def test_rank_killed_in_checkpoint_save_others_exit_last_good_stays(tiny_data: dict, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    argv = train_argv(tiny_data, *TP2, "--save", str(ckpt), "--save-interval", "2", iters=6)
    procs, ended = _run4(argv, tmp_path, "1 mid-write:model_optim_rng.pt 2 kill")  # rank 1 writes mp_rank_01
    _assert_survivors_name(tmp_path, procs, ended, 1, "the checkpoint save of iteration 4")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert integrity.verify(str(integrity.iteration_dir(str(ckpt), 2))) is None


@pytest.mark.slow
def test_rank_killed_in_evaluation_others_exit_naming_it(tiny_data: dict, tmp_path: Path) -> None:
    argv = train_argv(tiny_data, *DP4, "--split", "80,20,0", "--eval-iters", "1", "--eval-interval", "2", iters=4)
    procs, ended = _run4(argv, tmp_path, "3 eval-forward 1 kill")
    _assert_survivors_name(tmp_path, procs, ended, 3, "evaluation at iteration 2")


@pytest.mark.slow
def test_sigterm_at_one_rank_saves_and_exits_zero_on_every_rank(tiny_data: dict, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    argv = train_argv(tiny_data, *DP4, "--exit-signal-handler", "--save", str(ckpt), "--save-interval", "100",
                      iters=8)
    procs, _ = _run4(argv, tmp_path, "2 train-forward 3 term")
    for rank, proc in enumerate(procs):
        out = (tmp_path / f"rank{rank}.out").read_text()
        assert proc.returncode == 0, (rank, (tmp_path / f"rank{rank}.err").read_text()[-3000:])
        result = json.loads((tmp_path / f"rank{rank}.attempt0.json").read_text())
        assert result["iteration"] == 3 and sorted(result["train_losses"]) == ["1", "2", "3"]
        if rank == 0:
            assert "exiting program after receiving SIGTERM" in out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert integrity.verify(str(integrity.iteration_dir(str(ckpt), 3))) is None


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_from_last_checkpoint_exactly(tiny_data: dict, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    argv = train_argv(tiny_data, *DP4, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "3", iters=7)
    env = _env("2 train-forward 6 kill")  # first attempt: iterations 1-5 logged, 3 saved, rank 2 dies in step 6
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(key)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", "1",
         "--master-port", str(find_free_port()), "--monitor-interval", "0.1", "-m", "tests.reliability._rank_worker",
         str(tmp_path), *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((tmp_path / "fault.json").read_text())["rank"] == 2
    assert not list(tmp_path.glob("rank*.attempt0.json"))  # the first attempt never finished
    assert "loading checkpoint from" in proc.stdout
    before = {int(i): v["lm loss"] for i, v in json.loads((tmp_path / "fault.json").read_text())["result"]
              ["train_losses"].items()}
    results = [json.loads((tmp_path / f"rank{r}.attempt1.json").read_text()) for r in range(4)]
    after = {int(i): v["lm loss"] for i, v in results[0]["train_losses"].items()}
    assert sorted(before) == [1, 2, 3, 4, 5] and sorted(after) == [4, 5, 6, 7] and results[0]["iteration"] == 7
    assert all(r["train_losses"] == results[0]["train_losses"] for r in results)  # every DP rank agrees
    assert after[4] == before[4] and after[5] == before[5]  # resumed from iteration 3: the same curve, exactly


class _Store:
    """The few store calls the diagnosis makes, in memory."""

    def __init__(self, values: dict) -> None:
        self.values = dict(values)

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def multi_get(self, keys: list) -> list:
        return [self.values[k] for k in keys]

    def check(self, keys: list) -> bool:
        return all(k in self.values for k in keys)


def test_diagnosis_names_the_dead_and_the_silent_rank() -> None:
    import socket

    from megatron import peer_failure

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that is gone
    host = socket.gethostname()
    store = _Store({f"megatron/peer/{r}": f"{host} {pid}".encode() for r, pid in
                    [(0, os.getpid()), (1, os.getpid()), (2, dead.pid), (3, os.getpid())]})
    store.set("megatron/failed/1", "1")  # rank 1 failed too (a survivor); rank 3 neither failed nor died
    lost, ok = peer_failure.find_lost_ranks(store, 0, 4, wait_s=0.3)
    assert ok and lost == [f"rank 2 died (process {dead.pid} on {host} is gone)"]
    store.set("megatron/failed/2", "1")  # a survivor that exited after marking itself: not named as dead
    lost, ok = peer_failure.find_lost_ranks(store, 0, 4, wait_s=0.3)
    assert ok and lost == [f"rank 3 stopped responding (process {os.getpid()} on {host}: hung, or its node is lost)"]
    assert peer_failure.find_lost_ranks(_Store({}), 0, 4, wait_s=0.3) == ([], False)  # no store: said so


def test_peer_failure_recognises_communication_errors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron import peer_failure

    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")
    assert peer_failure.is_peer_failure(gloo)
    assert peer_failure.is_peer_failure(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    wrapped = ValueError("outer")
    wrapped.__cause__ = gloo
    assert peer_failure.is_peer_failure(wrapped)
    assert not peer_failure.is_peer_failure(RuntimeError("shape mismatch"))
    assert not peer_failure.peer_failure_in_run(gloo)  # no process group here: the usual traceback
    monkeypatch.delenv(peer_failure.TIMEOUT_ENV, raising=False)
    assert peer_failure.distributed_timeout(10).total_seconds() == 600
    monkeypatch.setenv(peer_failure.TIMEOUT_ENV, "2.5")
    assert peer_failure.distributed_timeout(10).total_seconds() == 2.5
