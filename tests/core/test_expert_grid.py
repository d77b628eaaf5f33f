"""The expert grid of --expert-tensor-parallel-size / --expert-model-parallel-size (megatron/core/parallel_state.py)
equals megatron-core 0.16.1's: its RankGenerator (order tp-cp-ep-dp-pp, the expert generator's tp = expert-TP) run
as the oracle in a subprocess gives the same expert-tensor-, expert-model- and expert-data-parallel groups for
layouts with expert-TP below, equal to and above TP; each rank's coordinates are its places in those groups. The
checkpoint writers (one per folder mp_rank_TT[_PPP]_EEE) are Megatron-LM's (expert-data-parallel rank 0) wherever
that rule writes every (TP rank, expert rank) folder once (expert-TP = TP, or expert-TP 1 with EP a multiple of TP)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.core.parallel_state import _build_rank_groups, checkpoint_writer, expert_coordinates
from tests.mcore_oracle import run_oracle

# (world, TP, PP, EP, expert-TP)
LAYOUTS = [(4, 2, 1, 2, 1), (2, 2, 1, 1, 1), (4, 1, 1, 1, 2), (4, 1, 1, 2, 2), (8, 2, 2, 2, 1), (8, 4, 1, 2, 1),
           (8, 1, 2, 2, 2), (8, 2, 1, 2, 2)]

ORACLE = r'''
import json
from megatron.core.parallel_state import RankGenerator
out = {}
for world, tp, pp, ep, etp in LAYOUTS:
    gen = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out[str((world, tp, pp, ep, etp))] = {name: gen.get_ranks(name) for name in ("tp", "ep", "dp")}
open("groups.json", "w").write(json.dumps(out))
'''


@pytest.mark.slow
def test_expert_grid_equals_megatron_core(tmp_path: Path) -> None:
    run_oracle(f"LAYOUTS = {LAYOUTS!r}\n" + ORACLE, tmp_path)
    theirs = json.loads((tmp_path / "groups.json").read_text())
    for world, tp, pp, ep, etp in LAYOUTS:
        layout = _build_rank_groups(world, tp, pp, None, 1, ep, etp)
        ref = theirs[str((world, tp, pp, ep, etp))]
        for mine, name in (("etp", "tp"), ("ep", "ep"), ("edp", "dp")):
            assert sorted(map(sorted, layout[mine])) == sorted(map(sorted, ref[name])), (world, tp, pp, ep, etp, mine)
        for rank in range(world):
            coords = expert_coordinates(rank, world, tp, pp, ep, etp)
            for key, groups in (("etp_rank", layout["etp"]), ("ep_rank", layout["ep"]), ("edp_rank", layout["edp"])):
                (group,) = [g for g in groups if rank in g]
                assert group.index(rank) == coords[key], (world, tp, pp, ep, etp, rank, key)
        writers = [r for r in range(world) if checkpoint_writer(r, world, tp, pp, ep, etp)]
        folders = {(r % tp, r // (world // pp), expert_coordinates(r, world, tp, pp, ep, etp)["ep_rank"])
                   for r in writers}
        assert len(folders) == len(writers)  # one writer per folder
        if etp == tp or (etp == 1 and ep % tp == 0):  # Megatron-LM's rule writes every folder once: the same ranks
            assert writers == [r for r in range(world) if expert_coordinates(r, world, tp, pp, ep, etp)["edp_rank"]
                               == 0], (world, tp, pp, ep, etp)
    # TP2 x expert-TP1 x EP1: Megatron-LM's rule would write TP rank 0's folder only; both TP ranks write here
    assert [r for r in range(2) if checkpoint_writer(r, 2, 2, 1, 1, 1)] == [0, 1]
