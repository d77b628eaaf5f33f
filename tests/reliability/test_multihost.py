"""Two hosts for real, on one machine: the examples/slurm scripts run under an `srun` stand-in on two Linux network
namespaces joined by a veth pair (tests/reliability/hosts.py, tests/reliability/slurm_standin.py), so that the
scripts' own address and rank logic, torchrun's rendezvous across hosts and gloo over the cluster interface
(GLOO_SOCKET_IFNAME) are what run. Skips, saying why, where `ip netns add` is not permitted.

- TP2 within a host x DP2 across hosts (pretrain_gpt_srun_torchrun.slurm: one `torchrun --nnodes 2
  --rdzv-endpoint node01:6000` per node) reproduces the serial run's losses (pretrain_gpt.slurm on one node) until
  node02 is lost mid-step (every process of its namespace SIGKILLed: its torchrun and both workers): the survivors
  on node01 exit within seconds with one line naming ranks 2 and 3 on node02.
- PP2 across hosts (pretrain_gpt_requeue.slurm, one task per node) reproduces an uninterrupted PP2 run across hosts
  (pretrain_gpt.slurm) until node02's link goes down mid-step: both sides exit at the time-out with one line each,
  and the last checkpoint (saved across hosts: one pipeline stage from each) stays the latest; the requeued job,
  given one node with two tasks, resumes from it and reproduces the uninterrupted run exactly until a USR1 makes it
  save and requeue itself. (PP2 equal to serial needs the serial run's initial weights: tests/pipeline shows it on
  one host.)
- node02 never arrives (its tasks hang before they start): under torchrun and under srun alone node01 exits at
  RDZV_TIMEOUT with one line naming node02 / rank 1 and the address; the requeued job runs normally.
- What the scripts export for gloo/NCCL across nodes (examples/slurm/slurm_common.sh), without training; for the
  DeepSpeed script also the hostfile, the launcher's line and the environment file pdsh gives the other nodes.
The losses are the log lines' (the scripts start pretrain_gpt.py themselves)."""
from __future__ import annotations

import math
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from megatron import peer_failure
from megatron.checkpoint import integrity
from megatron.launcher import detect_launcher_env
from megatron.presets import get_preset
from tests.log_lines import iteration_lines, iteration_values
from tests.reliability import slurm_standin
from tests.reliability.helpers import REPO
from tests.reliability.hosts import (
    Cluster,
    batch_env,
    create_cluster,
    destroy_cluster,
    link_bytes,
    netns_unavailable,
    slurm_bin,
    submit,
)

SLURM = REPO / "examples" / "slurm"
ITERS = 10
TINY = [*get_preset("gpt_micro_test").argv(), "--micro-batch-size", "1", "--global-batch-size", "4",
        "--lr-warmup-fraction", "0", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
TIMEOUT_S = 60  # MEGATRON_DISTRIBUTED_TIMEOUT_SECONDS: the survivors must exit well before it


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"two simulated hosts need network namespaces: {reason}")
    hosts = create_cluster(2)
    try:
        yield hosts
    finally:
        destroy_cluster(hosts)


def _job(cluster: Cluster, tiny_data: dict, tmp_path: Path, script: str, nodes: int, tasks_per_node: int,
         ckpt: str, job_id: int = 4242, **extra: str) -> subprocess.Popen:
    """Submit examples/slurm/`script` (TINY flags appended) as a job of `nodes` x `tasks_per_node` tasks."""
    settings = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SLURM_SUBMIT_DIR": str(REPO), "PRESET": "345m",
                "DATA_PATH": tiny_data["prefix"], "VOCAB_FILE": tiny_data["vocab"], "MERGE_FILE": tiny_data["merges"],
                "CHECKPOINT_PATH": str(tmp_path / ckpt), "TRAIN_ITERS": str(ITERS), "LR_DECAY_ITERS": str(ITERS),
                "SAVE_INTERVAL": "1000", "EVAL_INTERVAL": "1000", "MH_SCONTROL_LOG": str(tmp_path / "scontrol.log")}
    env = batch_env(cluster, slurm_bin(tmp_path / "bin"), job_id, nodes, tasks_per_node, **{**settings, **extra})
    return submit(cluster, SLURM / script, TINY, env, tmp_path)


def _finish(proc: subprocess.Popen, code: Optional[int] = 0) -> tuple[str, str]:
    """The job's remaining output, once it exited with `code` (None: any failure)."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code if code is not None else proc.returncode > 0, (proc.returncode, out[-2000:],
                                                                                 err[-3000:])
    return out, err


def _until(proc: subprocess.Popen, iteration: Optional[int] = None, text: Optional[str] = None) -> str:
    """The job's output up to the log line of `iteration` (or the first line holding `text`; the rest stays in the
    pipe). The iteration line is looked for anywhere in a line, as tests/log_lines.py reads it: tasks sharing one
    stdout may still glue a line of another process's (a C++ library's, or a Python print under PYTHONUNBUFFERED=1
    before megatron/core/rank_print.py wrote a line in one call) before it. On failure the whole output."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if (text is not None and text in line) or (iteration is not None and iteration in dict(iteration_lines(line))):
            return "".join(lines)
    raise AssertionError(f"no {text or f'iteration {iteration}'} in the job's output:\n" + "".join(lines)
                         + proc.stderr.read())


def test_tp2_within_host_dp2_across_hosts_equals_serial_until_node02_is_lost(cluster: Cluster, tiny_data: dict,
                                                                             tmp_path: Path) -> None:
    serial = iteration_values(_finish(_job(cluster, tiny_data, tmp_path, "pretrain_gpt.slurm", 1, 1, "serial"))[0])
    assert sorted(serial) == list(range(1, ITERS + 1))
    before = link_bytes(cluster, cluster.hosts[1])
    job = _job(cluster, tiny_data, tmp_path, "pretrain_gpt_srun_torchrun.slurm", 2, 1, "tp2dp2", TP="2",
               GPUS_PER_NODE="2", USE_DEEPSPEED="0", MEGATRON_DISTRIBUTED_TIMEOUT_SECONDS=str(TIMEOUT_S))
    first = _until(job, 5)
    assert link_bytes(cluster, cluster.hosts[1]) - before > 100_000  # the gradients crossed the veth link
    lost_at, killed = time.time(), cluster.kill_host(cluster.hosts[1])  # node02: its torchrun and both workers
    assert len(killed) == 3
    out, err = _finish(job, code=None)
    took = time.time() - lost_at
    parallel = iteration_values(first + out)
    assert 5 <= max(parallel) < ITERS and sorted(parallel) == list(range(1, max(parallel) + 1))
    for it, loss in parallel.items():
        assert math.isclose(loss, serial[it], rel_tol=1e-5), (it, loss, serial[it])
    # Both survivors are on node01; its torchrun stops the second once the first has failed: one line or two.
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert 1 <= len(errors) <= 2, err[-4000:]
    for line in errors:
        assert re.match(r"error: rank [01] of 4 stopped during training iteration \d+: rank 2 stopped responding "
                        r"\(process \d+ on node02: hung, or its node is lost\); rank 3 stopped responding "
                        r"\(process \d+ on node02: hung, or its node is lost\)", line), line
    assert took < TIMEOUT_S / 2, took
    print(f"node02 lost (torchrun): exited after {took:.1f} s")


def test_pp2_link_lost_then_requeued_on_one_host_resumes_exactly(cluster: Cluster, tiny_data: dict,
                                                                  tmp_path: Path) -> None:
    reference = iteration_values(_finish(_job(cluster, tiny_data, tmp_path, "pretrain_gpt.slurm", 2, 1, "ref",
                                              PP="2"))[0], as_text=True)
    assert sorted(reference) == list(range(1, ITERS + 1))
    # The job, across hosts: checkpoints every 3 iterations (stage 0 written on node01, stage 1 on node02); node02's
    # interface goes down once iteration 4 is logged (its process lives on; nothing resets the connections): each
    # side fails at the time-out with one line, node01's naming rank 1 on node02, node02's the store it cannot reach.
    timeout_s = 20  # short, yet longer than a start-up on a busy machine keeps one rank waiting for the other
    job = _job(cluster, tiny_data, tmp_path, "pretrain_gpt_requeue.slurm", 2, 1, "ckpt", PP="2", SAVE_INTERVAL="3",
               MEGATRON_DISTRIBUTED_TIMEOUT_SECONDS=str(timeout_s))
    first = _until(job, 4)
    cut_at = time.time()
    cluster.set_link(cluster.hosts[1], up=False)
    try:
        out, err = _finish(job, code=1)
    finally:
        cluster.set_link(cluster.hosts[1], up=True)
    took = time.time() - cut_at
    errors = sorted(line for line in err.splitlines() if line.startswith("error: "))
    assert len(errors) == 2 and "Traceback" not in err, err[-4000:]
    assert re.match(r"error: rank 0 of 2 stopped during training iteration \d+: rank 1 stopped responding "
                    r"\(process \d+ on node02: hung, or its node is lost\)", errors[0]), errors[0]
    assert re.match(r"error: rank 1 of 2 stopped during training iteration \d+: the rendezvous store at "
                    r"node01:6000 does not answer either", errors[1]), errors[1]
    assert "srun: error: node02 is unreachable" in err
    assert timeout_s < took < timeout_s + 30, took
    losses = iteration_values(first + out, as_text=True)
    ckpt = tmp_path / "ckpt"
    last = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert last in (3, 6) and max(losses) < ITERS and all(losses[i] == reference[i] for i in losses)
    assert sorted(p.name for p in (ckpt / f"iter_{last:07d}").iterdir()) == ["manifest.json", "mp_rank_00_000",
                                                                              "mp_rank_00_001"]
    assert integrity.verify(str(integrity.iteration_dir(str(ckpt), last))) is None
    # Requeued (SLURM requeues a job with --requeue whose node failed) onto one node, two tasks: resumes from `last`.
    job = _job(cluster, tiny_data, tmp_path, "pretrain_gpt_requeue.slurm", 1, 2, "ckpt", PP="2")
    # The time limit nears as the loop starts (every rank's handler is in place by then): save after the next
    # iteration, exit, requeue. (Sent after an iteration's line instead, it could arrive once the 6 left had run.)
    resumed = _until(job, text="[before the start of training step]")
    job.send_signal(signal.SIGUSR1)
    out, _ = _finish(job)
    resumed = iteration_values(resumed + out, as_text=True)
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert last < saved < ITERS and sorted(resumed) == list(range(last + 1, saved + 1)), (saved, resumed)
    assert all(resumed[i] == reference[i] for i in resumed)
    assert "requeueing job 4242" in out and (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert integrity.verify(str(integrity.iteration_dir(str(ckpt), saved))) is None
    print(f"link down: both sides exited {took:.1f} s later (time-out {timeout_s} s); resumed from {last}, "
          f"saved {saved}")


def test_standin_task_env_is_what_the_launcher_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The srun stand-in's block distribution, read back by megatron/launcher.py as a real srun's would be."""
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-02]")
    monkeypatch.setenv("MASTER_PORT", "6000")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    opts, command = slurm_standin.parse_srun(["--kill-on-bad-exit=1", "--ntasks-per-node", "2", "-N", "2",
                                               "python", "pretrain_gpt.py", "--x"])
    assert opts == {"kill_on_bad_exit": True, "ntasks_per_node": 2, "nodes": 2}
    assert command == ["python", "pretrain_gpt.py", "--x"]
    placed = []
    for node, local in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        env = {k: v for k, v in slurm_standin.task_env(node, local, f"node{node + 1:02d}", opts).items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("OMPI_")}
        got = detect_launcher_env(env)
        placed.append((got.launcher, got.rank, got.world_size, got.local_rank, got.master_addr, got.master_port,
                       env["SLURMD_NODENAME"], env["SLURM_TASKS_PER_NODE"]))
    assert placed == [("slurm", r, 4, r % 2, "node01", 6000, f"node{r // 2 + 1:02d}", "2(x2)") for r in range(4)]
    assert slurm_standin.expand_nodelist("node[01-02]") == ["node01", "node02"]


def test_a_store_that_does_not_answer_is_unreachable() -> None:
    """Towards a host whose link is down a store read blocks in recv() past the store's time-out: the diagnosis asks
    in a thread and gives up after its own bound (the link-down test above hung without it)."""
    never = threading.Event()

    class Silent:
        def check(self, keys: list) -> bool:
            never.wait()
            return True

    class Answers:
        def check(self, keys: list) -> bool:
            return keys == ["megatron/failed/1"]

    start = time.monotonic()
    assert not peer_failure.store_answers(Silent(), "megatron/failed/1", wait_s=0.2)
    assert time.monotonic() - start < 2
    assert peer_failure.store_answers(Answers(), "megatron/failed/1", wait_s=0.2)
    never.set()


def test_node02_never_arrives_survivors_exit_at_the_rendezvous_timeout(cluster: Cluster, tiny_data: dict,
                                                                         tmp_path: Path) -> None:
    """node02's tasks hang before they start (MH_STALLED_NODES): under torchrun (its c10d rendezvous) and under srun
    alone (the ranks' own wait before the process group), node01 exits 1 at RDZV_TIMEOUT with one line naming what is
    missing and the address it waited at; srun then kills node02's tasks and nothing is left on either node; the
    requeued job (node02 back) runs normally."""
    rdzv_s = 5  # counted from node01's own arrival: node02 never comes, so short is not flaky
    torchrun = _job(cluster, tiny_data, tmp_path, "pretrain_gpt_srun_torchrun.slurm", 2, 1, "a", job_id=51,
                    GPUS_PER_NODE="1", USE_DEEPSPEED="0", RDZV_TIMEOUT=str(rdzv_s), MH_STALLED_NODES="node02")
    direct = _job(cluster, tiny_data, tmp_path, "pretrain_gpt.slurm", 2, 1, "b", job_id=52, MASTER_PORT="6001",
                  RDZV_TIMEOUT=str(rdzv_s), MH_STALLED_NODES="node02")
    start = time.time()
    (_, err_a), (_, err_b) = _finish(torchrun, code=1), _finish(direct, code=1)
    took = time.time() - start
    line_a = [line for line in err_a.splitlines() if line.startswith("error: ")]
    assert line_a == [f"error: torchrun's rendezvous at node01:6000 (id 51) did not complete in {rdzv_s} s: --nnodes 2 "
                      "and 1 of 2 nodes arrived (node01 (this node)); node02 (SLURM_JOB_NODELIST) never did: it is "
                      "lost, did not start torchrun, or cannot reach node01:6000. Requeue or resubmit the job (it "
                      "resumes from --load); RDZV_TIMEOUT in examples/slurm (torchrun --rdzv-conf join_timeout=S) "
                      "sets this wait"], err_a[-3000:]
    line_b = [line for line in err_b.splitlines() if line.startswith("error: ")]
    assert line_b == [f"error: rank 0 of 2: the rendezvous at node01:6001 did not complete in {rdzv_s} s: rank 1 (on "
                      "node02) never arrived (1 of 2 ranks did, from node01): their node is lost or its tasks did not "
                      "start. Requeue or resubmit the job (it resumes from --load); MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS "
                      "(RDZV_TIMEOUT in examples/slurm) sets this wait"], err_b[-3000:]
    assert "Traceback" not in err_a + err_b and "multinode: MASTER_ADDR=node01 (10.77.0.1)" in err_b
    assert not cluster.pids(cluster.hosts[0]) and not cluster.pids(cluster.hosts[1])  # the requeue starts clean
    assert took < rdzv_s + 60, took
    # Requeued with node02 back: the same nodes, port and checkpoint folder; it runs normally (2 iterations here).
    requeued = _job(cluster, tiny_data, tmp_path, "pretrain_gpt.slurm", 2, 1, "b", job_id=52, MASTER_PORT="6001",
                    RDZV_TIMEOUT=str(rdzv_s), TRAIN_ITERS="2", LR_DECAY_ITERS="2")
    assert sorted(iteration_values(_finish(requeued)[0])) == [1, 2]
    print(f"node02 never arrived: both jobs exited {took:.1f} s after submission (RDZV_TIMEOUT {rdzv_s} s); "
          "the requeued job ran")


def _multinode_env(cluster: Cluster, tmp_path: Path, host: int = 0, **extra: str) -> subprocess.CompletedProcess:
    """examples/slurm/slurm_common.sh's `multinode_env` as the batch script runs it on node0`host`+1; prints env."""
    env = batch_env(cluster, slurm_bin(tmp_path / "bin"), 61, 2, 1, PYTHONPATH=str(REPO), **extra)
    script = "source examples/slurm/slurm_common.sh && multinode_env && env"
    return subprocess.run(cluster.argv(cluster.hosts[host], ["bash", "-c", script]), env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def _chosen(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    names = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS")
    return {k: v for k, v in (line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line) if k in names}


def test_slurm_scripts_choose_master_and_socket_interface(cluster: Cluster, tmp_path: Path) -> None:
    """What the SLURM scripts export for gloo and NCCL across nodes (no training): the master is the job's first node,
    the interface the one holding its address (hostnet0, not the loopback), a setting of the user's wins, a master
    whose name maps to the loopback gets the default route's interface, and a master that does not resolve is one
    line. (NCCL itself cannot run here: no GPU; the variables are the ones NCCL reads.)"""
    assert _chosen(_multinode_env(cluster, tmp_path)) == {
        "MASTER_ADDR": "node01", "MASTER_PORT": "6000", "GLOO_SOCKET_IFNAME": "hostnet0",
        "NCCL_SOCKET_IFNAME": "hostnet0"}
    assert _chosen(_multinode_env(cluster, tmp_path, NCCL_SOCKET_IFNAME="ib0", RDZV_TIMEOUT="30",
                                  MASTER_PORT="6100")) == {
        "MASTER_ADDR": "node01", "MASTER_PORT": "6100", "GLOO_SOCKET_IFNAME": "hostnet0", "NCCL_SOCKET_IFNAME": "ib0",
        "MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS": "30"}
    assert _chosen(_multinode_env(cluster, tmp_path, SOCKET_IFNAME="eth7"))["NCCL_SOCKET_IFNAME"] == "eth7"
    node01 = cluster.hosts[0].netns
    subprocess.run(["ip", "-n", node01, "route", "add", "default", "via", cluster.hosts[1].addr], check=True)
    try:  # the hostname resolves to the loopback (Debian's 127.0.1.1 line): the default route's interface instead
        chosen = _chosen(_multinode_env(cluster, tmp_path, MASTER_ADDR="127.0.0.1"))
    finally:
        subprocess.run(["ip", "-n", node01, "route", "del", "default"], check=True)
    assert (chosen["GLOO_SOCKET_IFNAME"], chosen["NCCL_SOCKET_IFNAME"]) == ("hostnet0", "hostnet0")
    bad = _multinode_env(cluster, tmp_path, SLURM_JOB_NODELIST="ghost[1-2]")
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1] == (
        "error: the master node ghost1 (first host of SLURM_JOB_NODELIST=ghost[1-2]) does not resolve on node01: fix "
        "the cluster's DNS or /etc/hosts, or export MASTER_ADDR=<its IP address>")


def test_deepspeed_script_exports_for_every_node_and_builds_the_launcher_line(cluster: Cluster, tiny_data: dict,
                                                                               tmp_path: Path) -> None:
    """pretrain_gpt_deepspeed.slurm on node01 with a `deepspeed` that records what it was given (no training): the
    master, port and interfaces of slurm_common.sh; the hostfile; and, since pdsh gives the other nodes' ranks only
    DeepSpeed's environment file, a file (DS_ENV_FILE) holding the user's ~/.deepspeed_env first, then the interfaces
    and the rendezvous wait the user's file does not set."""
    bin_dir = slurm_bin(tmp_path / "bin")
    (bin_dir / "deepspeed").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$MH_DS_ARGV"\nenv > "$MH_DS_ENV"\n')
    (bin_dir / "deepspeed").chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_HCA=mlx5_0\nNCCL_SOCKET_IFNAME=ib0\n")
    settings = {"PYTHONPATH": str(REPO), "SLURM_SUBMIT_DIR": str(REPO), "HOME": str(home), "PRESET": "345m",
                "DATA_PATH": tiny_data["prefix"], "VOCAB_FILE": tiny_data["vocab"], "MERGE_FILE": tiny_data["merges"],
                "CHECKPOINT_PATH": str(tmp_path / "ckpt"), "GPUS_PER_NODE": "1", "RDZV_TIMEOUT": "30",
                "DS_CONFIG": str(REPO / "examples" / "ds_config_gpt.json"),
                "MH_DS_ARGV": str(tmp_path / "argv"), "MH_DS_ENV": str(tmp_path / "env")}
    env = batch_env(cluster, bin_dir, 71, 2, 1, **settings)
    proc = subprocess.run(cluster.argv(cluster.hosts[0], ["bash", str(SLURM / "pretrain_gpt_deepspeed.slurm"),
                                                          "--seed", "7"]),
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    hostfile = str(tmp_path / "ckpt" / "hostfile.71")
    assert argv[:11] == ["--hostfile", hostfile, "--launcher", "pdsh", "--num_nodes", "2", "--master_addr", "node01",
                         "--num_gpus", "1", "--master_port"] and argv[11:13] == ["6000", "pretrain_gpt.py"]
    assert argv[-2:] == ["--seed", "7"]
    assert Path(hostfile).read_text() == "node01 slots=1\nnode02 slots=1\n"
    launched = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert (launched["MASTER_ADDR"], launched["GLOO_SOCKET_IFNAME"], launched["NCCL_SOCKET_IFNAME"]) == (
        "node01", "hostnet0", "hostnet0")
    ds_env = tmp_path / "ckpt" / "deepspeed_env.71"
    assert launched["DS_ENV_FILE"] == str(ds_env)
    assert ds_env.read_text().splitlines() == ["NCCL_IB_HCA=mlx5_0", "NCCL_SOCKET_IFNAME=ib0",
                                               "GLOO_SOCKET_IFNAME=hostnet0", "MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS=30"]
