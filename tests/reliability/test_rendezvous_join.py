"""A node missing at start-up (megatron/rendezvous_join.py, the quiet torchrun's rendezvous time-out): the one line
names the missing ranks, their node and the address, from SLURM's and torchrun's environment; in-process, with
torch's in-memory store and a fake clock (the two-host runs are in test_multihost.py)."""
from __future__ import annotations

import argparse
import base64
import os
import pickle
import socket
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from megatron import initialize, rendezvous_join
from megatron.launcher import LauncherEnv, parse_slurm_nodelist
from megatron.quiet_torchrun import RendezvousWatch, rendezvous_nodes, rendezvous_timeout_line
from megatron.rendezvous_join import RendezvousIncompleteError

SLURM_4 = {"SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "gpu-a[001-002]", "SLURM_TASKS_PER_NODE": "2(x2)"}


class Clock:
    """Time that passes one second per reading (no sleeping)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _arrive(store: Any, ranks: dict) -> None:
    for rank, host in ranks.items():
        store.set(f"{rendezvous_join.KEY}{rank}", f"{host} 1234")


def _missing(world: int, arrived: dict, env: dict, rank: int = 0) -> str:
    store = dist.HashStore()
    _arrive(store, arrived)
    with pytest.raises(RendezvousIncompleteError) as info:
        rendezvous_join.wait_for_ranks(store, rank, world, timedelta(seconds=5), "gpu-a001:6000", "gpu-a001", env=env,
                                       clock=Clock(), poll_s=0)
    return str(info.value)


def test_srun_block_distribution_names_the_node_of_the_missing_ranks() -> None:
    line = _missing(4, {1: "gpu-a001"}, SLURM_4)
    assert line == ("rank 0 of 4: the rendezvous at gpu-a001:6000 did not complete in 5 s: ranks 2-3 (on gpu-a002) "
                    "never arrived (2 of 4 ranks did, from gpu-a001): their node is lost or its tasks did not start. "
                    "Requeue or resubmit the job (it resumes from --load); MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS "
                    "(RDZV_TIMEOUT in examples/slurm) sets this wait")


def test_torchrun_names_a_node_by_its_other_ranks_or_the_job_nodes_that_sent_none() -> None:
    env = {"TORCHELASTIC_RUN_ID": "7", "LOCAL_WORLD_SIZE": "2", "SLURM_PROCID": "0",
           "SLURM_JOB_NODELIST": "gpu-a[001-003,007],gpu-b12"}
    # rank 3 shares node group 1 with rank 2, which arrived from gpu-a003; group 2 (ranks 4-5) sent nobody.
    line = _missing(6, {1: "gpu-a001", 2: "gpu-a003"}, env)
    assert ("rank 3 (on gpu-a003); ranks 4-5 (on one of gpu-a002, gpu-a007, gpu-b12: the job's nodes that sent no "
            "rank) never arrived (3 of 6 ranks did, from gpu-a001, gpu-a003)") in line
    assert "ranks 1-3 never arrived" in _missing(4, {}, {})  # no launcher information: the ranks alone


def test_every_rank_arrived_returns_and_a_vanished_store_is_one_line() -> None:
    store = dist.HashStore()
    _arrive(store, {1: "n1", 2: "n2"})
    rendezvous_join.wait_for_ranks(store, 0, 3, timedelta(seconds=1), "n1:6000", "n1", env={}, clock=Clock(),
                                   poll_s=0)
    assert store.get(f"{rendezvous_join.KEY}0").decode().split()[0] == "n1"

    class Gone:
        def set(self, key: str, value: str) -> None:
            pass

        def check(self, keys: list) -> bool:
            raise RuntimeError("Connection reset by peer")

    with pytest.raises(RendezvousIncompleteError, match=r"^the rendezvous store at n1:6000 stopped answering while "
                       r"this rank waited for the others .*Connection reset by peer\); requeue or resubmit the job$"):
        rendezvous_join.wait_for_ranks(Gone(), 1, 2, timedelta(seconds=1), "n1:6000", "n2", env={}, clock=Clock())


def test_another_jobs_store_on_the_same_port_is_not_joined() -> None:
    """Job 8's rank 1 reached job 7's store (both jobs on one node with MASTER_PORT 6000; job 8's rank 0 failed to
    listen): job 7's arrivals do not count, rank 0 of job 8 is named."""
    store = dist.HashStore()
    for rank in (0, 1):
        store.set(rendezvous_join.arrival_key(rank, {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}), "gpu-a001 1")
    env = {**SLURM_4, "SLURM_PROCID": "1", "SLURM_JOB_ID": "8", "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "1(x2)"}
    with pytest.raises(RendezvousIncompleteError, match=r"^rank 1 of 2: .*: rank 0 \(on gpu-a001\) never arrived "
                       r"\(1 of 2 ranks did, from gpu-a002\)"):
        rendezvous_join.wait_for_ranks(store, 1, 2, timedelta(seconds=5), "gpu-a001:6000", "gpu-a002", env=env,
                                       clock=Clock(), poll_s=0)


def test_slurm_rank_hosts_reads_the_compressed_forms() -> None:
    env = {"SLURM_JOB_NODELIST": "gpu-a[001-003,007],gpu-b12", "SLURM_TASKS_PER_NODE": "2(x3),1,3"}
    hosts = rendezvous_join.slurm_rank_hosts(env, 10)
    assert [hosts[r] for r in range(10)] == ["gpu-a001"] * 2 + ["gpu-a002"] * 2 + ["gpu-a003"] * 2 + ["gpu-a007"] + [
        "gpu-b12"] * 3
    assert rendezvous_join.slurm_rank_hosts(env, 8) == {}  # the counts do not add up: nothing is guessed
    assert rendezvous_join.slurm_rank_hosts({**env, "SLURM_TASKS_PER_NODE": "2(x)"}, 10) == {}
    assert parse_slurm_nodelist("gpu-a[001-003,007],gpu-b12") == ["gpu-a001", "gpu-a002", "gpu-a003", "gpu-a007",
                                                                    "gpu-b12"]


def test_join_timeout_env() -> None:
    default = timedelta(minutes=10)
    assert rendezvous_join.join_timeout(default, {}) == default
    assert rendezvous_join.join_timeout(default, {rendezvous_join.TIMEOUT_ENV: "12.5"}) == timedelta(seconds=12.5)
    for bad in ("soon", "0", "-3"):
        with pytest.raises(rendezvous_join.MegatronUserError, match=rf"^MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS='{bad}' "
                           r"\(RDZV_TIMEOUT in the example SLURM scripts\) must be a positive number of seconds"):
            rendezvous_join.join_timeout(default, {rendezvous_join.TIMEOUT_ENV: bad})


def test_real_store_rank0_alone_then_rank1_without_rank0(monkeypatch: pytest.MonkeyPatch) -> None:
    """initialize's rendezvous on torch's TCPStore: rank 0 alone names rank 1; rank 1 with no rank 0 names the store;
    both ranks together get their store (the "default_pg" prefix torch's tcp:// uses)."""
    monkeypatch.setenv(rendezvous_join.TIMEOUT_ENV, "1")
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    port = initialize.find_free_port()
    timeout = timedelta(seconds=30)
    with pytest.raises(RendezvousIncompleteError, match=rf"^rank 0 of 2: the rendezvous at 127.0.0.1:{port} did not "
                       r"complete in 1 s: rank 1 never arrived \(1 of 2 ranks did, from "):
        initialize.rendezvous_kwargs("unused", LauncherEnv("env", 0, 2, 0, "127.0.0.1", port), port, timeout)
    port = initialize.find_free_port()
    with pytest.raises(RendezvousIncompleteError, match=rf"^rank 1 of 2: the rendezvous store at 127.0.0.1:{port} "
                       r"\(opened by rank 0\) did not answer in 1 s: that node is lost"):
        initialize.rendezvous_kwargs("unused", LauncherEnv("env", 1, 2, 0, "127.0.0.1", port), port, timeout)
    got: dict = {}

    def join(rank: int) -> None:
        got[rank] = initialize.rendezvous_kwargs("unused", LauncherEnv("env", rank, 2, 0, "127.0.0.1", port), port,
                                                 timeout)["store"]

    port = initialize.find_free_port()
    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    got[1].set("k", "v")
    assert got[0].get("k") == b"v" and got[0].check([f"{rendezvous_join.KEY}1"])


def test_torchrun_rendezvous_timeout_line() -> None:
    args = argparse.Namespace(rdzv_conf="join_timeout=15,read_timeout=60", rdzv_endpoint="gpu-a001:6000",
                              rdzv_id="99", nnodes="3", local_addr=None)
    env = {"SLURM_JOB_NODELIST": "gpu-a[001-002],gpu-b12"}
    line = rendezvous_timeout_line(args, env)
    assert line.startswith("error: torchrun's rendezvous at gpu-a001:6000 (id 99) did not complete in 15 s: "
                           "--nnodes 3 and not every node arrived (this node: ")
    assert "; the job's other nodes (SLURM_JOB_NODELIST): " in line and "gpu-b12" in line
    args.rdzv_conf = ""
    assert "did not complete in 600 s" in rendezvous_timeout_line(args, {})  # torch's default join_timeout


def test_a_master_name_that_does_not_resolve_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def unknown(host: str, *args: Any, **kwargs: Any) -> list:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    with pytest.raises(RendezvousIncompleteError, match=r"^MASTER_ADDR=gpu-a001 \(the master, as the slurm launcher "
                       r"gives it\) does not resolve on .* \(Name or service not known\): fix the cluster's DNS or "
                       r"/etc/hosts, or export MASTER_ADDR=<the master's IP address>$"):
        initialize.rendezvous_kwargs("unused", LauncherEnv("slurm", 1, 2, 0, "gpu-a001", 6000), 6000,
                                     timedelta(seconds=30))


def test_torchrun_rendezvous_of_three_nodes_names_the_one_that_never_came() -> None:
    """torch's own c10d rendezvous handler, two of three "nodes" (two handlers with the addresses node01 and node02,
    as torchrun's --local-addr gives them) on loopback, node03 absent: both time out; the state in the store then
    names nobody (each node removed itself), but the watch, reading it while they waited, names exactly node03."""
    port = initialize.find_free_port()
    endpoint, wait_s = f"127.0.0.1:{port}", 2
    watch = RendezvousWatch(endpoint, "t41", wait_s=10, interval_s=0.1).start()
    failures = {}

    def node(name: str) -> None:
        params = RendezvousParameters("c10d", endpoint, "t41", 3, 3, local_addr=name, join_timeout=str(wait_s))
        try:
            get_rendezvous_handler(params).next_rendezvous()
        except RendezvousTimeoutError as exc:
            failures[name] = exc

    threads = [threading.Thread(target=node, args=(name,)) for name in ("node01", "node02")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(failures) == ["node01", "node02"]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    assert rendezvous_nodes(store.get("torch.rendezvous.t41"))[2] == []  # what torch leaves after the time-out
    arrived = watch.stop()
    assert arrived == ["node01", "node02"]
    args = argparse.Namespace(rdzv_conf=f"join_timeout={wait_s}", rdzv_endpoint=endpoint, rdzv_id="t41", nnodes="3",
                              local_addr="node02")
    assert rendezvous_timeout_line(args, {"SLURM_JOB_NODELIST": "node[01-03]"}, arrived) == (
        f"error: torchrun's rendezvous at {endpoint} (id t41) did not complete in 2 s: --nnodes 3 and 2 of 3 nodes "
        f"arrived (node01, node02 (this node)); node03 (SLURM_JOB_NODELIST) never did: it is lost, did not start "
        f"torchrun, or cannot reach {endpoint}. Requeue or resubmit the job (it resumes from --load); RDZV_TIMEOUT "
        "in examples/slurm (torchrun --rdzv-conf join_timeout=S) sets this wait")
    # Without SLURM the line names who came; a watch that missed this node's round falls back to the candidates.
    assert "2 of 3 nodes arrived (node01, node02 (this node)); the missing ones are lost" in rendezvous_timeout_line(
        args, {}, arrived)
    assert "not every node arrived (this node: node02; the job's other nodes (SLURM_JOB_NODELIST): node01, node03)" in (
        rendezvous_timeout_line(args, {"SLURM_JOB_NODELIST": "node[01-03]"}, ["node01"]))


def test_rendezvous_state_is_read_without_running_what_the_store_holds() -> None:
    """The watch unpickles only torch's rendezvous records and datetimes: anything else in the key reads as nothing."""
    assert rendezvous_nodes(base64.b64encode(pickle.dumps(os.system))) is None
    assert rendezvous_nodes(b"Y2FuaW1hZGFt") is None  # torch's empty-state sentinel
