"""Two (or more) hosts on one machine: Linux network namespaces joined by a veth pair, for the multi-node tests.

Each host is a network namespace with its own loopback, one interface named `IFNAME` (as every node of a cluster
has its `eth0`) with an address on a private /24, its own hostname (every process started in it gets a fresh UTS
namespace: ``unshare --uts`` + ``hostname nodeNN``) and an /etc/hosts naming every node (``ip netns exec`` binds
/etc/netns/<netns>/hosts over /etc/hosts). Processes of different hosts share the file system (the checkpoint folder
is then a shared file system, as on a cluster) and the process-id space, but nothing else a distributed run uses:
addresses, ports, hostnames. Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN); `netns_unavailable()` says why not.

    cluster = create_cluster(2)                 # node01 10.77.0.1, node02 10.77.0.2
    cluster.argv(cluster.hosts[1], ["python", "-m", ...])   # run it on node02
    cluster.kill_host(cluster.hosts[1])         # SIGKILL every process of node02 (a lost node)
    destroy_cluster(cluster)                    # always (a fixture's finaliser)
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

IFNAME = "hostnet0"  # the cluster interface's name inside every namespace (GLOO_SOCKET_IFNAME)
PREFIX = "mhtest-"  # namespace names: mhtest-<pid of the creating process>-<random>-<index>
NETNS_ETC = Path("/etc/netns")


@dataclass
class Host:
    """One simulated node: its hostname, network namespace and address on the cluster network."""

    name: str
    netns: str
    addr: str


@dataclass
class Cluster:
    """Hosts joined by veth pairs (host 0 is joined to each other host), torn down by `destroy_cluster`."""

    hosts: list[Host]
    tag: str
    links: list[str] = field(default_factory=list)  # the veth names in the root namespace (none stay there)

    @property
    def nodelist(self) -> str:
        """SLURM's compressed form of the host names, e.g. ``node[01-02]``."""
        return f"node[01-{len(self.hosts):02d}]"

    def argv(self, host: Host, command: list[str]) -> list[str]:
        """`command` run on `host`: in its network namespace, with its own hostname."""
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', host.name, *command]

    def pids(self, host: Host) -> list[int]:
        """Every process running in `host`'s network namespace."""
        out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, host: Host) -> list[int]:
        """SIGKILL every process of `host` (the node is lost); returns their ids."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def set_link(self, host: Host, up: bool) -> None:
        """Take `host`'s cluster interface down (its network is lost; the processes live on) or up again."""
        subprocess.run(["ip", "-n", host.netns, "link", "set", IFNAME, "up" if up else "down"], check=True)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def netns_unavailable() -> Optional[str]:
    """Why this process cannot create network namespaces (None when it can): the reason a test skips with."""
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "the `ip` (iproute2) or `unshare` (util-linux) command is not installed"
    probe = f"{PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"`ip netns add` is not permitted here ({proc.stderr.strip() or 'exit ' + str(proc.returncode)})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _remove_stale() -> None:
    """Remove namespaces left by a test process that was killed before its finaliser ran."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX) or name.startswith(PREFIX + "probe"):
            continue
        owner = name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _destroy_netns(name)


def create_cluster(num_hosts: int = 2, subnet: str = "10.77.0") -> Cluster:
    """`num_hosts` hosts node01.. at `subnet`.1.. (host 0 joined to each other host by a veth pair)."""
    _remove_stale()
    tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
    hosts = [Host(f"node{i + 1:02d}", f"{tag}-{i}", f"{subnet}.{i + 1}") for i in range(num_hosts)]
    cluster = Cluster(hosts, tag)
    try:
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in hosts)
        for host in hosts:
            _ip("netns", "add", host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            (NETNS_ETC / host.netns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / host.netns / "hosts").write_text(hosts_file)
        if num_hosts > 2:
            raise NotImplementedError("more than two hosts need a bridge; two are what the tests use")
        a, b = f"mh{os.getpid() % 100000}{uuid.uuid4().hex[:4]}", f"mh{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        cluster.links = [a, b]
        for host, link in zip(hosts, (a, b)):
            _ip("link", "set", link, "netns", host.netns)
            _ip("-n", host.netns, "link", "set", link, "name", IFNAME)
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
            _ip("-n", host.netns, "link", "set", IFNAME, "up")
    except Exception:
        destroy_cluster(cluster)
        raise
    return cluster


def _destroy_netns(name: str) -> None:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True)  # its veth end goes with it
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def destroy_cluster(cluster: Cluster) -> None:
    """Kill every process of every host, delete the namespaces (their veth ends with them) and the hosts files."""
    for host in cluster.hosts:
        _destroy_netns(host.netns)
    for link in cluster.links:  # only if creation stopped before it moved into a namespace
        subprocess.run(["ip", "link", "del", link], capture_output=True)


def slurm_bin(directory: Path) -> Path:
    """A folder with `srun` and `scontrol` stand-ins (tests/reliability/slurm_standin.py) to put first on PATH."""
    directory.mkdir(parents=True, exist_ok=True)
    for tool in ("srun", "scontrol"):
        (directory / tool).write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tests.reliability.slurm_standin {tool} "$@"\n')
        (directory / tool).chmod(0o755)
    return directory


def batch_env(cluster: Cluster, bin_dir: Path, job_id: int, nodes: int, tasks_per_node: int, **extra: str) -> dict:
    """The environment sbatch gives a batch script of `nodes` nodes x `tasks_per_node` tasks (plus `extra`), with the
    stand-ins first on PATH. Launcher variables of this process (RANK, MASTER_ADDR, ...) and the socket interfaces
    (GLOO_SOCKET_IFNAME: the scripts pick it) are not passed on."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "TORCHELASTIC", "MEGATRON_FAULT", "REL_FAULT"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    nodelist = f"node[01-{nodes:02d}]" if nodes > 1 else "node01"
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS"):
        env.pop(name, None)  # the scripts choose the interface themselves (examples/slurm/slurm_common.sh)
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
                "MH_CLUSTER": ",".join(f"{h.name}={h.netns}" for h in cluster.hosts[:nodes]),
                "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist,
                "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
                "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "SLURM_NTASKS": str(nodes * tasks_per_node),
                "SLURMD_NODENAME": "node01", **extra})
    return env


def submit(cluster: Cluster, script: Path, argv: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    """Start `bash script argv` as SLURM starts a batch script: on the job's first node (node01)."""
    return subprocess.Popen(cluster.argv(cluster.hosts[0], ["bash", str(script), *argv]), env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def link_bytes(cluster: Cluster, host: Host) -> int:
    """Bytes received on `host`'s cluster interface so far (what crossed the simulated network to it)."""
    out = subprocess.run(["ip", "-n", host.netns, "-s", "-j", "link", "show", IFNAME], capture_output=True,
                         text=True, check=True).stdout
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])
