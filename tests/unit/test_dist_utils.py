import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_run_distributed_allreduce():
    assert run_distributed(_allreduce, 2) == [3.0, 3.0]
