"""Start-up of a Megatron process: flags, globals, torch.distributed, model-parallel groups, seeds, C++ helpers.

`initialize_megatron()` works under torchrun / torch.distributed.launch, the DeepSpeed launcher, SLURM (srun),
single-process emulation (`MASTER_ADDR=localhost MASTER_PORT=6000 RANK=0 LOCAL_RANK=0 python ...`) and a plain
`python pretrain_gpt.py ...` (world size 1 on a free port). Backend: nccl with CUDA, gloo without.
"""
from __future__ import annotations

import argparse
import atexit
import os
import random
import socket
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron import peer_failure, process_guard, rendezvous_join, startup
from megatron.core import parallel_state
from megatron.core.context_parallel import describe_cp_layout
from megatron.core.expert_parallel import describe_ep_layout
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.data import helpers
from megatron.errors import ArgumentError, MegatronUserError
from megatron.global_vars import get_args, unset_global_variables

# Launcher detection lives in megatron/launcher.py (a leaf: megatron.arguments reads it while parsing); re-exported.
from megatron.launcher import DEFAULT_MASTER_PORT, LauncherEnv, detect_launcher_env, parse_slurm_nodelist  # noqa: F401
from megatron.progress import fit_cpu_threads
from megatron.run_configs.parallel import ParallelSizes, StartupSettings
from megatron.startup import resolve_backend  # noqa: F401 - Megatron-compatible name here too

_OWNS_PROCESS_GROUP = False
_ATEXIT_REGISTERED = False
_RENDEZVOUS_STORE: Optional[Any] = None  # use_rendezvous_store: the in-process restart's per-attempt store


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------------------------
# Initialisation
# --------------------------------------------------------------------------------------------------------------------


def _print0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def initialize_megatron(
    extra_args_provider: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None,
    args_defaults: Optional[Dict[str, Any]] = None,
    ignore_unknown_args: bool = False,
    args: Optional[List[str]] = None,
    allow_no_cuda: bool = True,
    skip_mpu_initialization: bool = False,
) -> Optional[argparse.Namespace]:
    """Parse + validate flags, set globals, init torch.distributed and model parallelism, seed, build helpers.

    Returns the args (None with `skip_mpu_initialization`). `allow_no_cuda` is accepted for Megatron compatibility:
    CPU runs are always allowed here.
    """
    del allow_no_cuda
    process_guard.exit_with_launcher_agent()  # under torchrun: die with the agent, never train unsupervised
    parsed = startup.run(extra_args_provider, args_defaults, ignore_unknown_args, args, skip_mpu_initialization)
    if skip_mpu_initialization:
        return None
    if getattr(parsed, "lazy_mpu_init", False):
        return parsed  # the caller (e.g. an external framework) finishes later with finish_mpu_init()
    finish_mpu_init(parsed)
    return parsed


def finish_mpu_init(args: Optional[argparse.Namespace] = None) -> None:
    """Second half of start-up: torch.distributed, model-parallel groups, seeds, deterministic mode, helpers. The
    process's rank, world size, local rank and backend are already on ``args`` (megatron.startup.placement); the
    process group they describe is started here, and a different one already running is an error."""
    args = get_args() if args is None else args
    start = StartupSettings.from_args(args)
    if start.deterministic_mode:  # before torch.distributed: NCCL reads NCCL_ALGO when it builds communicators
        set_deterministic_mode()
    fit_cpu_threads()  # without OMP_NUM_THREADS: each local process gets its share of the cores
    placed = _start_process_group(start)
    _check_placement(vars(args), placed)
    _initialize_model_parallel(ParallelSizes.from_args(args), start, placed["rank"])
    if start.deterministic_mode:
        _print0(f"> deterministic mode: torch deterministic algorithms on, cuDNN benchmark off, "
                f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}, NCCL_ALGO={os.environ['NCCL_ALGO']}")
    _print0(f"> setting random seeds to {start.seed} ...")
    set_random_seed(start.seed, start.data_parallel_random_init)
    _compile_dependencies()


class ProcessGroupStartError(MegatronUserError, RuntimeError):
    """torch.distributed could not start (a port in use, an address not reachable): one line naming the address,
    the rank and the launcher, not a traceback."""


def _check_placement(recorded: Dict[str, Any], placed: Dict[str, Any]) -> None:
    """The process group that runs is the one start-up recorded on ``args`` (nothing is written onto it here)."""
    for key, value in placed.items():
        if recorded.get(key) != value:
            raise RuntimeError(f"start-up recorded {key}={recorded.get(key)!r} but torch.distributed runs "
                               f"with {key}={value!r}: start torch.distributed before initialize_megatron, or let "
                               "it start the process group")


def _start_process_group(start: StartupSettings) -> Dict[str, Any]:
    """Init torch.distributed (unless already up); returns what Megatron records on args (rank, world_size, and
    local_rank when it started the group; distributed_backend), in Megatron's order."""
    global _OWNS_PROCESS_GROUP, _ATEXIT_REGISTERED
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    placed: Dict[str, Any] = {}
    if dist.is_initialized():
        _print0("torch distributed is already initialized, skipping initialization ...")
        placed.update(rank=dist.get_rank(), world_size=dist.get_world_size())
        peer_failure.register(placed["rank"])  # to name a dead rank later
        if cuda and start.distributed_backend != "gloo":
            torch.cuda.set_device(start.local_rank % torch.cuda.device_count())
    else:
        env = detect_launcher_env(os.environ)
        backend = resolve_backend(start.distributed_backend, cuda)
        if env.world_size != start.world_size:
            raise RuntimeError(f"world size changed between parse_args ({start.world_size}) and init "
                               f"({env.world_size})")
        if env.rank == 0:
            print("> initializing torch distributed ...", flush=True)
        if cuda:
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        port = env.master_port if env.master_port is not None else find_free_port()
        # Libraries that read the env (DeepSpeed, torch elastic helpers) see the same rendezvous.
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(port))
        os.environ.setdefault("RANK", str(env.rank))
        os.environ.setdefault("WORLD_SIZE", str(env.world_size))
        os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
        init_method = f"tcp://{_format_host(env.master_addr)}:{port}"
        timeout = peer_failure.distributed_timeout(start.distributed_timeout_minutes)
        try:
            dist.init_process_group(backend=backend, world_size=env.world_size, rank=env.rank, timeout=timeout,
                                    **rendezvous_kwargs(init_method, env, port, timeout))
        except rendezvous_join.RendezvousIncompleteError:
            raise
        except (RuntimeError, ValueError, OSError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ProcessGroupStartError(
                f"torch.distributed ({backend}) could not start at {init_method} as rank {env.rank} of "
                f"{env.world_size} ({env.launcher} launcher): {first_line}. Check MASTER_ADDR/MASTER_PORT "
                "(is the port free and the same on every rank?)"
            ) from exc
        _OWNS_PROCESS_GROUP = True
        peer_failure.register(env.rank)  # to name a dead rank later
        if not _ATEXIT_REGISTERED:
            atexit.register(_destroy_process_group_at_exit)
            _ATEXIT_REGISTERED = True
        placed.update(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank)
    placed["distributed_backend"] = dist.get_backend()
    return placed


def _initialize_model_parallel(sizes: ParallelSizes, start: StartupSettings, rank: int) -> None:
    """The model-parallel groups (unless already built); rank 0 prints their sizes."""
    if parallel_state.model_parallel_is_initialized():
        _print0("model parallel is already initialized")
        return
    state = parallel_state.initialize_model_parallel(
        sizes.tensor_model_parallel_size,
        sizes.pipeline_model_parallel_size,
        sizes.virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_split_rank=sizes.pipeline_model_parallel_split_rank,
        timeout=peer_failure.distributed_timeout(start.distributed_timeout_minutes),  # bounds every group's wait
        expert_model_parallel_size=sizes.expert_model_parallel_size,
        context_parallel_size=sizes.context_parallel_size,
        expert_tensor_parallel_size=sizes.expert_tensor_parallel_size,
    )
    if rank == 0:
        print(f"> initialized tensor model parallel with size {state.tp_size}", flush=True)
        print(f"> initialized pipeline model parallel with size {state.pp_size}", flush=True)
        if state.cp_size > 1:
            print(describe_cp_layout(start.seq_length, state.cp_size, start.cp_comm_type), flush=True)
        if start.num_experts and state.expert_groups:
            print(describe_ep_layout(start.num_experts, state.ep_size, state.etp_size or state.tp_size,
                                     state.edp_size), flush=True)


def use_rendezvous_store(store: Optional[Any]) -> None:
    """Start the next process group on `store` (a per-attempt PrefixStore of megatron/inprocess_restart.py's store
    that outlives the process groups) instead of the tcp:// address; None: the address again."""
    global _RENDEZVOUS_STORE
    _RENDEZVOUS_STORE = store


def rendezvous_kwargs(init_method: str, env: LauncherEnv, port: int, timeout: Any) -> Dict[str, Any]:
    """init_process_group's rendezvous: a store on the master's address (rank 0 hosts it, as torch's tcp:// does, under
    the same "default_pg" prefix), or under torchrun's agent store a per-restart prefix; in both, every rank waits
    there for the others at most the rendezvous time-out and names the missing ones (megatron/rendezvous_join.py).

    torchrun (`--max-restarts N`) keeps one store for all restarts; torch's own tcp:// and env:// rendezvous reuse
    the same keys in it, so a restarted rank can read the address a dead rank of the previous attempt published and
    fail ("Gloo connectFullMesh failed ... Connection refused"). Each attempt gets its own key prefix here.
    """
    if _RENDEZVOUS_STORE is not None:
        return {"store": _RENDEZVOUS_STORE}
    if env.world_size == 1:
        return {"init_method": init_method}
    join, where = rendezvous_join.join_timeout(timeout), f"{_format_host(env.master_addr)}:{port}"
    rendezvous_join.check_resolves(env.master_addr, port, env.launcher)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and attempt is not None
    try:
        server = dist.TCPStore(env.master_addr, port, env.world_size, is_master=env.rank == 0 and not agent,
                               timeout=join, wait_for_workers=False, multi_tenant=not agent)
    except dist.DistNetworkError as exc:
        if "timed out" not in str(exc):
            raise
        raise rendezvous_join.store_unreachable(env.rank, env.world_size, where, join) from exc
    store = dist.PrefixStore(f"megatron/attempt_{attempt}" if agent else "default_pg", server)
    rendezvous_join.wait_for_ranks(store, env.rank, env.world_size, join, where, socket.gethostname())
    server.set_timeout(timeout)
    return {"store": store}


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def set_random_seed(seed: int, data_parallel_random_init: bool = False) -> None:
    """Megatron's `_set_random_seed`: seed + 100 * pp_rank (+ 10 * dp_rank) for python, numpy, torch, TP tracker."""
    if seed is None or seed <= 0:
        raise ValueError(f"--seed must be a positive integer (got {seed})")
    state = parallel_state.current_parallel_state()
    seed = seed + 100 * state.pp_rank
    if data_parallel_random_init:
        seed = seed + 10 * state.dp_rank
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    model_parallel_manual_seed(seed, state.tp_rank, state.pp_rank)


_set_random_seed = set_random_seed  # Megatron's private name


NCCL_DETERMINISTIC_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def set_deterministic_mode(env: Optional[Dict[str, str]] = None) -> None:
    """--deterministic-mode: every switch that makes two identical runs bitwise identical.

    torch.use_deterministic_algorithms(True) (ops without a deterministic kernel raise instead of running), cuDNN
    deterministic with autotuning (benchmark) off, CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS needs it for
    reproducible GEMMs) and a fixed NCCL all-reduce algorithm (NCCL_ALGO=Ring unless set; NVLS/SHARP reductions
    are not reproducible), each environment variable only when the user has not set it. Attention then avoids
    the fused SDPA kernels on CUDA and flash attention is refused at argument validation.
    """
    env = os.environ if env is None else env
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.setdefault("NCCL_ALGO", "Ring")
    if env["NCCL_ALGO"].lower() not in {a.lower() for a in NCCL_DETERMINISTIC_ALGOS}:
        raise ArgumentError(
            f"--deterministic-mode: NCCL_ALGO={env['NCCL_ALGO']} is not one of {', '.join(NCCL_DETERMINISTIC_ALGOS)}; "
            "unset it (Ring is used) or pick one of those")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


_set_deterministic = set_deterministic_mode  # the old private name


def _compile_dependencies() -> None:
    """Build (rank 0) and load (everyone) the dataset index helpers."""
    start = time.time()
    _print0("> compiling dataset index builder ...")
    helpers.compile_helpers_rank0()
    _print0(f">>> done with dataset index builder. Compilation time: {time.time() - start:.3f} seconds")


def _destroy_process_group_at_exit() -> None:
    global _OWNS_PROCESS_GROUP
    if _OWNS_PROCESS_GROUP and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
            pass
    _OWNS_PROCESS_GROUP = False


def destroy_megatron(unset_globals: bool = True) -> None:
    """Tear down model-parallel state, the process group (if initialize_megatron created it) and the globals."""
    parallel_state.destroy_model_parallel()
    _destroy_process_group_at_exit()
    if unset_globals:
        unset_global_variables()


def get_initialized_args() -> argparse.Namespace:
    """Alias of megatron.global_vars.get_args for scripts that only import this module."""
    return get_args()
