"""Where this process sits in the job, from the launcher's environment: torchrun / torch.distributed.launch, the
DeepSpeed launcher, mpirun (OpenMPI), SLURM (srun, with its compressed node lists) or nothing (world size 1).

Pure functions of the environment (no torch): `megatron.arguments` reads the rank and world size from here while
parsing, and `megatron.initialize` the master address and port when it starts torch.distributed.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from itertools import product
from typing import List, Mapping, Optional

DEFAULT_MASTER_PORT = 6000

@dataclass
class LauncherEnv:
    """Where this process sits in the job, as told by the launcher's environment variables."""

    launcher: str  # "torchrun" | "deepspeed" | "mpi" | "slurm" | "env" (RANK set, no WORLD_SIZE) | "none"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: Optional[int]  # None: pick a free port (world size 1 only)


def _int_env(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _port_env(env: Mapping[str, str], default: Optional[int]) -> Optional[int]:
    if "MASTER_PORT" not in env or env["MASTER_PORT"] == "":
        return default
    port = _int_env(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise ValueError(f"environment variable MASTER_PORT={port} is not a valid TCP port (1-65535)")
    return port


def detect_launcher_env(env: Optional[Mapping[str, str]] = None) -> LauncherEnv:
    """Read rank / world size / master address from torchrun, DeepSpeed, mpirun, SLURM or nothing (world size 1)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "deepspeed" if "CROSS_RANK" in env or "DEEPSPEED_LAUNCHER" in env else "torchrun"
        rank, world_size = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
        local_rank = _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        port = _port_env(env, DEFAULT_MASTER_PORT if world_size > 1 else None)
        result = LauncherEnv(launcher, rank, world_size, local_rank, env.get("MASTER_ADDR", "localhost"), port)
    elif "RANK" in env:
        # Single-process emulation of a launcher: RANK (and maybe MASTER_*) set by hand, no WORLD_SIZE.
        rank = _int_env(env, "RANK")
        if rank != 0:
            raise ValueError(f"RANK={rank} is set without WORLD_SIZE; set WORLD_SIZE too (or RANK=0 for one process)")
        local_rank = _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        result = LauncherEnv("env", 0, 1, local_rank, env.get("MASTER_ADDR", "localhost"), _port_env(env, None))
    elif "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        # mpirun (OpenMPI), e.g. DeepSpeed's --deepspeed_mpi; checked before SLURM (mpirun inside an allocation).
        rank, world_size = _int_env(env, "OMPI_COMM_WORLD_RANK"), _int_env(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0
        addr = env.get("MASTER_ADDR")
        if not addr:
            if world_size > 1:
                raise ValueError("mpirun job without MASTER_ADDR: cannot find the master node; "
                                 "export MASTER_ADDR=<host of rank 0> (mpirun -x MASTER_ADDR)")
            addr = "localhost"
        port = _port_env(env, DEFAULT_MASTER_PORT if world_size > 1 else None)
        result = LauncherEnv("mpi", rank, world_size, local_rank, addr, port)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world_size = _int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_NTASKS")
        local_rank = _int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        addr = env.get("MASTER_ADDR")
        if not addr:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_STEP_NODELIST")
            if nodelist:
                addr = parse_slurm_nodelist(nodelist)[0]
            elif world_size == 1:
                addr = "localhost"
            else:
                raise ValueError("SLURM job without SLURM_JOB_NODELIST or MASTER_ADDR: cannot find the master node; "
                                 "export MASTER_ADDR=<first node>")
        port = _port_env(env, DEFAULT_MASTER_PORT if world_size > 1 else None)
        result = LauncherEnv("slurm", rank, world_size, local_rank, addr, port)
    else:
        result = LauncherEnv("none", 0, 1, 0, env.get("MASTER_ADDR", "localhost"), _port_env(env, None))
    if result.world_size < 1 or not 0 <= result.rank < result.world_size:
        raise ValueError(f"launcher environment gives rank {result.rank} outside world size {result.world_size}")
    return result


_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> List[str]:
    """Split on commas outside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM nodelist {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"SLURM nodelist {text!r}: unbalanced '['")
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(spec: str, nodelist: str) -> List[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] keeping zero padding."""
    out = []
    for item in spec.split(","):
        m = _RANGE_RE.match(item.strip())
        if m is None:
            raise ValueError(f"SLURM nodelist {nodelist!r}: cannot parse range {item!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        width = len(lo)
        if int(hi) < int(lo):
            raise ValueError(f"SLURM nodelist {nodelist!r}: range {item!r} is decreasing")
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def parse_slurm_nodelist(nodelist: str) -> List[str]:
    """Expand SLURM's compressed host list: 'node[01-03,07],other' -> node01 node02 node03 node07 other."""
    hosts: List[str] = []
    for part in _split_top_level(nodelist):
        # Alternate literal text and bracketed range sets; expand as a cartesian product.
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = []
        for piece in pieces:
            if piece.startswith("["):
                choices.append(_expand_ranges(piece[1:-1], nodelist))
            elif piece:
                choices.append([piece])
        hosts.extend("".join(combo) for combo in product(*choices))
    if not hosts:
        raise ValueError(f"SLURM nodelist {nodelist!r} contains no hosts")
    return hosts
