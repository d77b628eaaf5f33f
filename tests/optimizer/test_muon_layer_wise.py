"""--optimizer dist_muon's layer-wise distribution (megatron/optimizer/layer_wise.py) in one process: two simulated
data-parallel ranks each step only the parameters Megatron-LM's ping-pong deal gives them and keep state for those
only; the owners' parameters together equal the undistributed step, and the gathered state dict equals the
undistributed one. (The 2-process curves, all-gather and resume: tests/training/test_muon_curves.py.)"""
from __future__ import annotations

import copy

import torch

from megatron.optimizer import layer_wise
from megatron.optimizer.layer_wise import LayerWiseShards, ping_pong_owners
from megatron.optimizer.muon import MuonWithAdamW, muon_param_groups
from megatron.optimizer.param_groups import get_param_groups
from tests.optimizer.test_muon import LR, WD, _llama, _run


def test_ping_pong_deal_is_megatrons() -> None:
    # megatron-core's example: 4 ranks, 10 params sorted by size -> [[p0,p7,p8],[p1,p6,p9],[p2,p5],[p3,p4]]
    owners = ping_pong_owners(list(range(10)), 4)
    assert [[i for i in range(10) if owners[i] == r] for r in range(4)] == [[0, 7, 8], [1, 6, 9], [2, 5], [3, 4]]
    assert ping_pong_owners([30, 10, 20], 2) == [1, 0, 1]  # by size: 10 -> rank 0, 20 -> rank 1, 30 -> rank 1


def _optimizer(model: torch.nn.Module, dp_group) -> MuonWithAdamW:
    groups = muon_param_groups([model], get_param_groups(model), True)
    return MuonWithAdamW(groups, lr=LR, weight_decay=WD, fp32_matmul_prec="high", dp_group=dp_group)


def test_two_ranks_step_their_own_matrices_and_together_equal_the_serial_step(monkeypatch) -> None:
    model, shapes = _llama()
    serial_model = copy.deepcopy(model)
    serial = _optimizer(serial_model, None)
    _run(serial_model, shapes, serial)
    monkeypatch.setattr(layer_wise.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(LayerWiseShards, "all_gather_params", lambda self, groups: None)  # checked by hand below
    models, opts = [], []
    for rank in range(2):
        monkeypatch.setattr(layer_wise.dist, "get_rank", lambda group=None, rank=rank: rank)
        models.append(copy.deepcopy(model))
        opts.append(_optimizer(models[-1], "dp"))
    owned = [o.layer_wise.owned for o in opts]
    everything = {(g, i) for g, grp in enumerate(opts[0].param_groups) for i in range(len(grp["params"]))}
    assert owned[0] and owned[1] and owned[0] | owned[1] == everything and not owned[0] & owned[1]
    for m, o in zip(models, opts):
        # one step at a time on the owners' values: the serial run's trajectory needs every param each step
        _run(m, shapes, o)
    for rank, o in enumerate(opts):
        held = {(g, i) for g, grp in enumerate(o.param_groups) for i, p in enumerate(grp["params"]) if p in o.state}
        assert held == owned[rank], f"rank {rank} keeps state for other ranks' parameters"
    # Each parameter's trajectory depends only on its own grads, so the owners' values are the serial run's.
    for (g, grp) in enumerate(serial.param_groups):
        for i, want in enumerate(grp["params"]):
            owner = 0 if (g, i) in owned[0] else 1
            got = opts[owner].param_groups[g]["params"][i]
            assert torch.equal(got, want), (g, i)


def test_gathered_state_dict_equals_the_serial_one(monkeypatch) -> None:
    model, shapes = _llama()
    serial_model = copy.deepcopy(model)
    serial = _optimizer(serial_model, None)
    _run(serial_model, shapes, serial)
    monkeypatch.setattr(layer_wise.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(LayerWiseShards, "all_gather_params", lambda self, groups: None)
    opts = []
    for rank in range(2):
        monkeypatch.setattr(layer_wise.dist, "get_rank", lambda group=None, rank=rank: rank)
        m = copy.deepcopy(model)
        opts.append(_optimizer(m, "dp"))
        _run(m, shapes, opts[-1])
    assert opts[0].state_dict_is_collective
    local = {}

    def exchange(out, obj, group=None):  # rank 1 first (records its part), then rank 0 (gets it)
        local.setdefault("rank1", obj)
        out[:] = [obj, local["rank1"]] if "rank0" in local else [None, obj]

    monkeypatch.setattr(layer_wise.dist, "all_gather_object", exchange)
    opts[1].state_dict()
    local["rank0"] = True
    gathered, want = opts[0].state_dict(), serial.state_dict()
    assert sorted(gathered["state"]) == sorted(want["state"])
    for k, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(gathered["state"][k][key]), torch.as_tensor(value)), (k, key)
    # loaded back on a rank, only its own parameters keep state
    opts[1].load_state_dict(gathered)
    held = {(g, i) for g, grp in enumerate(opts[1].param_groups) for i, p in enumerate(grp["params"])
            if p in opts[1].state}
    assert held == opts[1].layer_wise.owned


def test_one_rank_is_undistributed(monkeypatch) -> None:
    monkeypatch.setattr(layer_wise.dist, "get_world_size", lambda group=None: 1)
    model, _ = _llama()
    opt = _optimizer(model, "dp")
    assert not opt.state_dict_is_collective and len(opt.layer_wise.owned) == sum(
        len(g["params"]) for g in opt.param_groups)
