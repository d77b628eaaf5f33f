"""Every rank must arrive at start-up: a node that never does (lost, or its tasks never started) is named in one line.

Before the process group starts, each rank writes ``host pid`` under ``megatron/joined/<rank>`` in the rendezvous
store and waits, at most the rendezvous time-out, until every rank has. If one never does, every rank that arrived
exits 1 with one line naming the missing ranks, their node where it can be known (SLURM's block distribution from
SLURM_JOB_NODELIST / SLURM_TASKS_PER_NODE; under torchrun a node whose other ranks arrived, or the job's nodes that
sent none) and the address of the store, instead of waiting in torch's rendezvous for the whole
--distributed-timeout-minutes with a message that names nobody.

The time-out: MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS (the example SLURM scripts set it from RDZV_TIMEOUT, as they set
torchrun's ``--rdzv-conf join_timeout``), else --distributed-timeout-minutes. Pure logic plus a store (no torch import).
"""
from __future__ import annotations

import os
import re
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional

from megatron.errors import MegatronUserError
from megatron.launcher import parse_slurm_nodelist

TIMEOUT_ENV = "MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS"
KEY = "megatron/joined/"


class RendezvousIncompleteError(MegatronUserError, RuntimeError):
    """Some ranks never arrived at the start-up rendezvous; the message names them, their node and the store."""


def join_timeout(default: timedelta, env: Optional[Mapping[str, str]] = None) -> timedelta:
    """How long a rank waits for the others at start-up: MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS, else `default`."""
    env = os.environ if env is None else env
    value = env.get(TIMEOUT_ENV, "")
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise MegatronUserError(f"{TIMEOUT_ENV}={value!r} (RDZV_TIMEOUT in the example SLURM scripts) must be a "
                                "positive number of seconds; unset it to wait --distributed-timeout-minutes")
    return timedelta(seconds=seconds)


def slurm_rank_hosts(env: Mapping[str, str], world_size: int) -> Dict[int, str]:
    """The node of every rank under srun's default block distribution (SLURM_JOB_NODELIST with SLURM_TASKS_PER_NODE
    such as ``8(x2),4``); empty when the environment does not say (not SLURM, or the counts do not add up)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_STEP_NODELIST")
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not per_node:
        return {}
    try:
        hosts = parse_slurm_nodelist(nodelist)
    except ValueError:
        return {}
    counts: List[int] = []
    for item in per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            return {}
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    if len(counts) != len(hosts) or sum(counts) != world_size:
        return {}
    out, rank = {}, 0
    for host, count in zip(hosts, counts):
        for _ in range(count):
            out[rank] = host
            rank += 1
    return out


def _ranges(ranks: List[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def describe_missing(missing: List[int], joined: Dict[int, str], world_size: int, env: Mapping[str, str]) -> str:
    """'ranks 2-3 (node02)': the missing ranks grouped by the node they were to run on, where that can be known."""
    placed = slurm_rank_hosts(env, world_size) if "SLURM_PROCID" in env and "TORCHELASTIC_RUN_ID" not in env else {}
    local = int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
    if not placed and local > 0:  # torchrun: ranks g*L..g*L+L-1 run on one node; a node that sent any is known
        by_group = {r // local: host for r, host in joined.items()}
        placed = {r: by_group[r // local] for r in missing if r // local in by_group}
    groups: Dict[str, List[int]] = {}
    for r in missing:
        groups.setdefault(placed.get(r, ""), []).append(r)
    seen = set(joined.values())
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    unseen = [h for h in parse_slurm_nodelist(nodelist) if h not in seen] if nodelist else []
    parts = []
    for host, ranks in groups.items():
        label = f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)}"
        if host:
            parts.append(f"{label} (on {host})")
        elif unseen:
            parts.append(f"{label} (on {'one of ' if len(unseen) > 1 else ''}{', '.join(unseen)}: the job's "
                         f"node{'s' if len(unseen) > 1 else ''} that sent no rank)")
        else:
            parts.append(label)
    return "; ".join(parts)


def check_resolves(addr: str, port: int, launcher: str) -> None:
    """One line, not a time-out, when the master's name does not resolve on this node (a node whose DNS or
    /etc/hosts does not know the first host of the job)."""
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RendezvousIncompleteError(
            f"MASTER_ADDR={addr} (the master, as the {launcher} launcher gives it) does not resolve on "
            f"{socket.gethostname()} ({exc.strerror}): fix the cluster's DNS or /etc/hosts, or export "
            "MASTER_ADDR=<the master's IP address>") from exc


def store_unreachable(rank: int, world_size: int, where: str, timeout: timedelta,
                      env: Optional[Mapping[str, str]] = None) -> RendezvousIncompleteError:
    """The error of a rank whose connection to the rendezvous store at `where` timed out: rank 0 (or torchrun's
    agent) that opens it never came; names its node where SLURM says (the first of the job's nodes)."""
    env = os.environ if env is None else env
    host = slurm_rank_hosts(env, world_size).get(0, "") if "TORCHELASTIC_RUN_ID" not in env else ""
    opener = "torchrun's agent on the first node" if "TORCHELASTIC_RUN_ID" in env else "rank 0"
    return RendezvousIncompleteError(
        f"rank {rank} of {world_size}: the rendezvous store at {where} (opened by {opener}{', on ' + host if host else ''}"
        f") did not answer in {timeout.total_seconds():g} s: that node is lost, its task did not start, or this node "
        f"cannot reach it (MASTER_ADDR, GLOO_SOCKET_IFNAME). Requeue or resubmit the job (it resumes from --load); "
        f"{TIMEOUT_ENV} (RDZV_TIMEOUT in examples/slurm) sets this wait")


def arrival_key(rank: int, env: Mapping[str, str]) -> str:
    """The key of `rank`'s arrival: per SLURM job step where SLURM says, so that ranks that reach another job's store
    (two jobs on one node with the same MASTER_PORT) wait for their own job's ranks and name them, not start on it."""
    job = env.get("SLURM_JOB_ID", "")
    step = env.get("SLURM_STEP_ID", "")
    return f"{KEY}job{job}.{step}/{rank}" if job else f"{KEY}{rank}"


def _arrived(store: Any, keys: List[str], where: str) -> bool:
    try:
        return bool(store.check(keys))
    except Exception as exc:  # noqa: BLE001 - torch's store errors have no common public base
        raise RendezvousIncompleteError(
            f"the rendezvous store at {where} stopped answering while this rank waited for the others (the rank that "
            f"hosts it gave up waiting or its node is lost: {' '.join(str(exc).split())[:120]}); requeue or resubmit "
            "the job") from exc


def wait_for_ranks(store: Any, rank: int, world_size: int, timeout: timedelta, where: str, host: str,
                   env: Optional[Mapping[str, str]] = None, clock: Callable[[], float] = time.monotonic,
                   poll_s: float = 0.2) -> None:
    """Write this rank's arrival in `store` and wait until all `world_size` ranks have, at most `timeout`; else raise
    RendezvousIncompleteError naming the missing ranks and their node (`where`: the store's address)."""
    env = os.environ if env is None else env
    keys = [arrival_key(r, env) for r in range(world_size)]
    store.set(keys[rank], f"{host} {os.getpid()}")
    end = clock() + timeout.total_seconds()
    while not _arrived(store, keys, where):
        if clock() >= end:
            arrived = [r for r in range(world_size) if store.check([keys[r]])]
            joined = {r: bytes(v).decode().split()[0] for r, v in
                      zip(arrived, store.multi_get([keys[r] for r in arrived]))}
            missing = [r for r in range(world_size) if r not in joined]
            hosts = sorted(set(joined.values()))
            raise RendezvousIncompleteError(
                f"rank {rank} of {world_size}: the rendezvous at {where} did not complete in "
                f"{timeout.total_seconds():g} s: {describe_missing(missing, joined, world_size, env)} never "
                f"arrived ({len(joined)} of {world_size} ranks did, from {', '.join(hosts)}): their node is lost or "
                f"its tasks did not start. Requeue or resubmit the job (it resumes from --load); "
                f"{TIMEOUT_ENV} (RDZV_TIMEOUT in examples/slurm) sets this wait")
        time.sleep(poll_s)  # polling the store for the others' arrival (no blocking wait with a deadline here)
