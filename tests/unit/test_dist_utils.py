import os
import sys

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_run_distributed_allreduce():
    assert run_distributed(_allreduce, 2) == [3.0, 3.0]


def _environment_and_cwd(rank, world_size):
    return os.environ.get("DIST_UTILS_PROBE"), os.getcwd(), torch.get_num_threads()


def test_workers_see_the_parent_environment_and_working_directory_of_the_launch(monkeypatch, tmp_path):
    """The workers are forks of a server started once (tests/dist_utils.py): they still get the environment and the
    working directory the parent has when it launches them, as spawned interpreters would."""
    monkeypatch.setenv("DIST_UTILS_PROBE", "first")
    run_distributed(_allreduce, 2)  # the fork server may start here, with DIST_UTILS_PROBE=first
    monkeypatch.setenv("DIST_UTILS_PROBE", "second")
    monkeypatch.chdir(tmp_path)
    assert run_distributed(_environment_and_cwd, 2, threads=2) == [("second", str(tmp_path), 2)] * 2


def _already_imported(rank, world_size):
    return [name in sys.modules for name in ("torch._dynamo", "megatron.training")]


def test_workers_start_with_torch_dynamo_and_megatron_training_imported():
    """The fork server imported them once (tests/forkserver_preload.py): this module imports neither, and a rank that
    builds an optimizer or trains does not pay for them again."""
    assert run_distributed(_already_imported, 2) == [[True, True]] * 2
