"""Process-group layout: pure rank arithmetic for 8/16 ranks, real gloo groups for 4 ranks, clear errors."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from tests.dist_utils import run_distributed


def test_layout_8_ranks_tp2_pp2():
    g = ps._build_rank_groups(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["position_embedding"] == [[0], [1], [2], [3]]


def test_layout_16_ranks_tp2_pp4_matches_megatron_docstring():
    # Megatron's initialize_model_parallel docstring example: 16 GPUs, TP 2, PP 4 -> DP 2.
    g = ps._build_rank_groups(16, tp=2, pp=4)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]


@pytest.mark.parametrize("world,tp,pp", [(8, 1, 1), (8, 8, 1), (8, 1, 8), (8, 2, 4), (16, 4, 2), (16, 2, 2)])
def test_layout_partitions_and_formula(world, tp, pp):
    g = ps._build_rank_groups(world, tp, pp)
    dp = world // (tp * pp)
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("mp", tp * pp)):
        flat = sorted(r for grp in g[kind] for r in grp)
        assert flat == list(range(world)), kind  # a partition of all ranks
        assert all(len(grp) == size for grp in g[kind]), kind
    for rank in range(world):
        c = ps.rank_coordinates(rank, world, tp, pp)
        assert rank == c["pp_rank"] * tp * dp + c["dp_rank"] * tp + c["tp_rank"]
        tp_grp = next(grp for grp in g["tp"] if rank in grp)
        assert tp_grp.index(rank) == c["tp_rank"]
        pp_grp = next(grp for grp in g["pp"] if rank in grp)
        assert pp_grp.index(rank) == c["pp_rank"]
        dp_grp = next(grp for grp in g["dp"] if rank in grp)
        assert dp_grp.index(rank) == c["dp_rank"]


@pytest.mark.parametrize("world,tp,pp", [(8, 3, 1), (6, 2, 2), (4, 8, 1), (4, 0, 1)])
def test_impossible_layout_is_a_clear_error(world, tp, pp):
    with pytest.raises(ValueError, match="tensor-model-parallel"):
        ps._build_rank_groups(world, tp, pp)


def test_single_state_and_uninitialised_errors():
    s = ps.ParallelState.single()
    assert s.tp_group is None and s.dp_group is None and s.pp_group is None
    assert (s.tp_size, s.pp_size, s.dp_size, s.world_size) == (1, 1, 1, 1)
    assert s.is_pipeline_first_stage() and s.is_pipeline_last_stage()
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_parallel_state()
    with pytest.raises(RuntimeError, match="torch.distributed"):
        ps.initialize_model_parallel(1, 1)


def test_virtual_pipeline_stage_predicates():
    s = ps.ParallelState(pp_rank=0, pp_size=2, virtual_pp_rank=0, virtual_pp_size=2, pp_ranks=[0, 1])
    assert s.is_pipeline_first_stage() and not s.is_pipeline_last_stage()
    s.set_virtual_pipeline_model_parallel_rank(1)
    assert not s.is_pipeline_first_stage() and s.is_pipeline_first_stage(ignore_virtual=True)
    assert not s.is_pipeline_last_stage()
    last = ps.ParallelState(pp_rank=1, pp_size=2, virtual_pp_rank=1, virtual_pp_size=2, pp_ranks=[0, 1])
    assert last.is_pipeline_last_stage() and last.pp_next_rank() == 0 and last.pp_prev_rank() == 0


def _members(group) -> list:
    """Global ranks in `group`, learned by communication (proves the group really contains them); [] for None
    (a rank outside every group of that kind, e.g. a middle pipeline stage and the embedding group)."""
    if group is None:
        return []
    world = dist.get_world_size(group)
    parts = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([float(dist.get_rank())]), group=group)
    return [int(p.item()) for p in parts]


def _layouts_body(rank, world_size):
    out = {}
    for tp, pp in ((2, 2), (2, 1), (1, 4), (4, 1), (1, 1)):
        s = ps.initialize_model_parallel(tp, pp)
        assert ps.get_parallel_state() is s
        out[(tp, pp)] = {
            "tp": _members(s.tp_group), "dp": _members(s.dp_group), "pp": _members(s.pp_group),
            "mp": _members(s.mp_group), "emb": _members(s.embedding_group),
            "coords": (s.tp_rank, s.dp_rank, s.pp_rank, s.tp_size, s.dp_size, s.pp_size),
            "pp_ranks": s.pp_ranks, "first": s.is_pipeline_first_stage(), "last": s.is_pipeline_last_stage(),
            "tp_src": s.tp_src_rank(), "dp_ranks": s.dp_ranks(), "next": s.pp_next_rank(), "prev": s.pp_prev_rank(),
        }
    try:
        ps.initialize_model_parallel(3, 1)
    except ValueError as e:
        out["error"] = str(e)
    s = ps.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2)
    out["vpp"] = (s.virtual_pp_rank, s.virtual_pp_size, s.is_pipeline_first_stage(), s.is_pipeline_last_stage())
    ps.destroy_model_parallel()
    return out


def test_real_groups_world4():
    results = run_distributed(_layouts_body, 4)
    for rank, r in enumerate(results):
        x = r[(2, 2)]  # ranks: tp pairs (0,1),(2,3); pp pairs (0,2),(1,3); dp size 1
        assert x["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert x["pp"] == [rank % 2, rank % 2 + 2] and x["pp_ranks"] == x["pp"]
        assert x["dp"] == [rank] and x["mp"] == [0, 1, 2, 3]
        assert x["emb"] == [rank % 2, rank % 2 + 2]
        assert x["coords"] == (rank % 2, 0, rank // 2, 2, 1, 2)
        assert x["first"] == (rank < 2) and x["last"] == (rank >= 2)
        assert x["tp_src"] == rank - rank % 2 and x["next"] == x["prev"] == (rank + 2) % 4
        y = r[(2, 1)]  # tp2 dp2
        assert y["tp"] == [rank - rank % 2, rank - rank % 2 + 1] and y["dp"] == [rank % 2, rank % 2 + 2]
        assert y["pp"] == [rank] and y["coords"] == (rank % 2, rank // 2, 0, 2, 2, 1) and y["emb"] == [rank]
        assert y["dp_ranks"] == y["dp"]
        z = r[(1, 4)]  # pp4
        assert z["pp"] == [0, 1, 2, 3] and z["tp"] == [rank] and z["dp"] == [rank]
        assert z["emb"] == ([0, 3] if rank in (0, 3) else [])
        assert z["coords"] == (0, 0, rank, 1, 1, 4) and z["next"] == (rank + 1) % 4 and z["prev"] == (rank - 1) % 4
        w = r[(4, 1)]
        assert w["tp"] == [0, 1, 2, 3] and w["dp"] == [rank] and w["coords"] == (rank, 0, 0, 4, 1, 1)
        d = r[(1, 1)]
        assert d["dp"] == [0, 1, 2, 3] and d["coords"] == (0, rank, 0, 1, 4, 1)
        assert "not divisible" in r["error"] and "--tensor-model-parallel-size" in r["error"]
        assert r["vpp"] == (0, 2, rank < 2, False)
