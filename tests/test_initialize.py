"""Launcher detection, SLURM nodelist parsing, backend choice and real gloo start-ups of initialize_megatron."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.initialize import (
    DEFAULT_MASTER_PORT,
    detect_launcher_env,
    find_free_port,
    parse_slurm_nodelist,
    resolve_backend,
)
from tests.dist_utils import run_distributed

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
               "SLURM_STEP_NODELIST")


@pytest.mark.parametrize("nodelist,expected", [
    ("node01", ["node01"]),
    ("node[01-03,07],other", ["node01", "node02", "node03", "node07", "other"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
    ("a[1-2]-b[01-02]", ["a1-b01", "a1-b02", "a2-b01", "a2-b02"]),
    ("x1,y[098-100],z", ["x1", "y098", "y099", "y100", "z"]),
    ("host-1.cluster, host-2.cluster", ["host-1.cluster", "host-2.cluster"]),
])
def test_parse_slurm_nodelist(nodelist, expected):
    assert parse_slurm_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["node[01-03", "node]01[", "node[a-b]", "node[5-3]", ""])
def test_parse_slurm_nodelist_errors(bad):
    with pytest.raises(ValueError, match="SLURM nodelist"):
        parse_slurm_nodelist(bad)


def test_detect_torchrun_env():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    got = detect_launcher_env(env)
    assert (got.launcher, got.rank, got.world_size, got.local_rank) == ("torchrun", 3, 8, 1)
    assert (got.master_addr, got.master_port) == ("10.0.0.1", 29500)


def test_detect_deepspeed_env():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CROSS_RANK": "0", "MASTER_ADDR": "h",
           "MASTER_PORT": "29500"}
    got = detect_launcher_env(env)
    assert (got.launcher, got.rank, got.world_size, got.local_rank, got.master_port) == ("deepspeed", 1, 2, 1, 29500)


def test_detect_slurm_env():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-06]"}
    got = detect_launcher_env(env)
    assert (got.launcher, got.rank, got.world_size, got.local_rank) == ("slurm", 5, 8, 1)
    assert (got.master_addr, got.master_port) == ("gpu03", DEFAULT_MASTER_PORT)
    env.update(MASTER_ADDR="login1", MASTER_PORT="12345")
    got = detect_launcher_env(env)
    assert (got.master_addr, got.master_port) == ("login1", 12345)


def test_torchrun_wins_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "MASTER_PORT": "1234"}
    got = detect_launcher_env(env)
    assert (got.launcher, got.rank, got.world_size) == ("torchrun", 1, 4)


def test_detect_single_process_emulation_and_nothing():
    got = detect_launcher_env({"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "6001"})
    assert (got.launcher, got.rank, got.world_size, got.master_port) == ("env", 0, 1, 6001)
    got = detect_launcher_env({})
    assert (got.launcher, got.rank, got.world_size, got.local_rank, got.master_port) == ("none", 0, 1, 0, None)


@pytest.mark.parametrize("env,needle", [
    ({"RANK": "2"}, "WORLD_SIZE"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "4", "WORLD_SIZE": "2"}, "world size"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "MASTER_ADDR"),
])
def test_detect_launcher_env_errors(env, needle):
    with pytest.raises(ValueError, match=needle):
        detect_launcher_env(env)


def test_resolve_backend():
    assert resolve_backend(None, cuda_available=False) == "gloo"
    assert resolve_backend(None, cuda_available=True) == "nccl"
    assert resolve_backend("gloo", cuda_available=True) == "gloo"
    with pytest.raises(RuntimeError, match="--distributed-backend gloo"):
        resolve_backend("nccl", cuda_available=False)


# ---- real start-ups in fresh processes --------------------------------------------------------------------------

SCRIPT = r"""
import json, sys
import torch
from megatron.initialize import initialize_megatron, destroy_megatron
from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_rng_tracker
from megatron.global_vars import get_args, get_num_microbatches, get_timers

args = initialize_megatron(args=sys.argv[1:])
assert get_args() is args
state = parallel_state.get_parallel_state()
total = torch.ones(1) * (args.rank + 1)
torch.distributed.all_reduce(total)
default_draw = torch.rand(1).item()
with get_rng_tracker().fork():
    tracker_draw = torch.rand(1).item()
print("RESULT " + json.dumps(dict(
    rank=args.rank, world=args.world_size, tp_rank=state.tp_rank, dp=args.data_parallel_size,
    backend=args.distributed_backend, total=total.item(), default_draw=default_draw, tracker_draw=tracker_draw,
    microbatches=get_num_microbatches(), padded_vocab=args.padded_vocab_size, timers=get_timers() is not None)))
destroy_megatron()
assert not torch.distributed.is_initialized()
"""

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --lr 1e-3 --vocab-size 1000")


def _clean_env(repo_root) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = str(repo_root) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _launch(tmp_path, repo_root, envs, flags):
    script = tmp_path / "init_script.py"
    script.write_text(SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script), *flags.split()], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for env in envs]
    results = []
    try:
        outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        assert line, out
        results.append((json.loads(line[0][len("RESULT "):]), out))
    return results


def _reference_draws(seed: int, tp_rank: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    default = torch.rand(1, generator=gen).item()
    gen = torch.Generator().manual_seed(seed + 2718 + tp_rank)
    return default, torch.rand(1, generator=gen).item()


def test_single_process_with_nothing_set(tmp_path, repo_root):
    [(res, out)] = _launch(tmp_path, repo_root, [_clean_env(repo_root)], FLAGS)
    assert (res["rank"], res["world"], res["dp"], res["backend"]) == (0, 1, 1, "gloo")
    assert res["total"] == 1.0 and res["microbatches"] == 4 and res["timers"]
    assert res["padded_vocab"] == 1024  # 1000 padded to a multiple of 128
    assert (res["default_draw"], res["tracker_draw"]) == pytest.approx(_reference_draws(1234, 0))
    assert "> initialized tensor model parallel with size 1" in out
    assert "------------------------ arguments ------------------------" in out


def test_two_processes_torchrun_env(tmp_path, repo_root):
    port = str(find_free_port())
    envs = []
    for rank in range(2):
        env = _clean_env(repo_root)
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        envs.append(env)
    results = _launch(tmp_path, repo_root, envs, FLAGS + " --tensor-model-parallel-size 2 --seed 42")
    for rank, (res, _) in enumerate(results):
        assert (res["rank"], res["world"], res["tp_rank"], res["dp"]) == (rank, 2, rank, 1)
        assert res["total"] == 3.0 and res["microbatches"] == 4
        assert res["padded_vocab"] == 1024  # multiple of 128 * TP 2 = 256
        assert (res["default_draw"], res["tracker_draw"]) == pytest.approx(_reference_draws(42, rank))
    # Same default stream on both TP ranks, different tensor-parallel streams.
    assert results[0][0]["default_draw"] == results[1][0]["default_draw"]
    assert results[0][0]["tracker_draw"] != results[1][0]["tracker_draw"]


def test_two_processes_slurm_env(tmp_path, repo_root):
    port = str(find_free_port())
    envs = []
    for rank in range(2):
        env = _clean_env(repo_root)
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_JOB_NODELIST="localhost", MASTER_PORT=port)
        envs.append(env)
    results = _launch(tmp_path, repo_root, envs, FLAGS)
    for rank, (res, _) in enumerate(results):
        assert (res["rank"], res["world"], res["tp_rank"], res["dp"]) == (rank, 2, 0, 2)
        assert res["total"] == 3.0 and res["microbatches"] == 2


def _already_initialized_body(rank, world_size, flags):
    import torch

    from megatron.core import parallel_state
    from megatron.global_vars import get_num_microbatches
    from megatron.initialize import destroy_megatron, initialize_megatron

    args = initialize_megatron(args=flags.split())
    state = parallel_state.get_parallel_state()
    result = (args.rank, args.world_size, state.tp_rank, state.dp_size, get_num_microbatches())
    destroy_megatron()
    # The process group belongs to the caller (here the test harness): it must survive.
    assert torch.distributed.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()
    return result


def test_initialize_inside_existing_process_group():
    flags = FLAGS + " --tensor-model-parallel-size 2"
    results = run_distributed(_already_initialized_body, world_size=2, args=(flags,))
    assert results == [(0, 2, 0, 1, 4), (1, 2, 1, 1, 4)]


def test_a_port_in_use_is_one_line_naming_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of 2 whose MASTER_PORT is taken: a ProcessGroupStartError (a MegatronUserError: the entry scripts print
    it as one line) naming the address and the fix, raised at once."""
    import socket

    from megatron.errors import MegatronUserError
    from megatron.global_vars import unset_global_variables
    from megatron.initialize import ProcessGroupStartError, initialize_megatron

    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS", "5")
        try:
            with pytest.raises(ProcessGroupStartError) as err:
                initialize_megatron(args=FLAGS.split())
        finally:
            unset_global_variables()
    assert isinstance(err.value, MegatronUserError)
    line = str(err.value)
    assert "\n" not in line and f"tcp://127.0.0.1:{port} as rank 0 of 2" in line
    assert "MASTER_ADDR/MASTER_PORT" in line
