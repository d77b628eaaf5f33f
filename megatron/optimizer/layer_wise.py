"""Megatron-LM's layer-wise distribution of an optimizer over the data-parallel ranks (`--optimizer dist_muon`).

As megatron-core 0.16.1's LayerWiseDistributedOptimizer: every data-parallel rank keeps the whole model and, after
the DDP all-reduce, the whole gradient; the parameters (Muon's and Adam's alike) are sorted by size and dealt to the
ranks in ping-pong order (0, 1, .., n-1, n-1, .., 0, 0, ..), so each rank steps, and keeps optimizer state for, only
the whole matrices it owns (Muon orthogonalises whole matrices), then the updated parameters are all-gathered.
Routed-expert parameters (``allreduce = False``) are dealt over the expert-data-parallel group instead.

Checkpoints hold the state of every parameter, as the undistributed optimizer's: `gather_state` (collective over the
data-parallel groups) collects the owners' state at save time, and `prune_state` drops the others' after a load, so
a run resumes at any data-parallel size and with `--optimizer muon`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

Position = Tuple[int, int]  # (param group index, index in the group)


def ping_pong_owners(numels: List[int], world: int) -> List[int]:
    """The rank owning each parameter: sorted by numel (stable), dealt 0..world-1 then world-1..0, repeatedly."""
    loop = list(range(world)) + list(range(world))[::-1]
    owners = [0] * len(numels)
    for k, i in enumerate(sorted(range(len(numels)), key=lambda i: numels[i])):
        owners[i] = loop[k % len(loop)]
    return owners


def _is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


class _Domain:
    """The parameters dealt over one process group: the positions each rank owns."""

    def __init__(self, group: Any, by_rank: List[List[Position]]) -> None:
        self.group, self.by_rank = group, by_rank
        self.rank = dist.get_rank(group)


class LayerWiseShards:
    """Which (group, index) positions of `param_groups` this rank steps, and the all-gathers that follow."""

    def __init__(self, param_groups: List[dict], dp_group: Any, expert_dp_group: Optional[Any] = None) -> None:
        self.domains: List[_Domain] = []
        self.owned: set = set()
        for expert, group in ((False, dp_group), (True, expert_dp_group)):
            positions = [(g, i) for g, grp in enumerate(param_groups) for i, p in enumerate(grp["params"])
                         if (expert_dp_group is not None and _is_expert(p)) == expert]
            if not positions:
                continue
            world = dist.get_world_size(group) if group is not None else 1
            if world == 1:
                self.owned.update(positions)
                continue
            owners = ping_pong_owners([param_groups[g]["params"][i].numel() for g, i in positions], world)
            domain = _Domain(group, [[pos for pos, o in zip(positions, owners) if o == r] for r in range(world)])
            self.domains.append(domain)
            self.owned.update(domain.by_rank[domain.rank])

    @torch.no_grad()
    def all_gather_params(self, param_groups: List[dict]) -> None:
        """Every rank's updated parameters copied into the others' (one padded all-gather per group)."""
        for domain in self.domains:
            lists = [[param_groups[g]["params"][i] for g, i in positions] for positions in domain.by_rank]
            sizes = [sum(p.numel() for p in params) for params in lists]
            mine = lists[domain.rank]
            first = next(p for params in lists for p in params)
            flat = torch.zeros(max(sizes), device=first.device, dtype=first.dtype)
            if mine:
                flat[:sizes[domain.rank]] = torch.cat([p.detach().reshape(-1) for p in mine])
            gathered = [torch.empty_like(flat) for _ in lists]
            dist.all_gather(gathered, flat, group=domain.group)
            for r, params in enumerate(lists):
                if r == domain.rank:
                    continue
                offset = 0
                for p in params:
                    p.data.copy_(gathered[r][offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def gather_state(self, state: Dict[int, dict], param_groups: List[dict]) -> Dict[int, dict]:
        """A torch state_dict's ``state`` (keyed by flat param index) with every owner's entries (collective)."""
        index = _flat_indices(param_groups)
        merged = dict(state)
        for domain in self.domains:
            mine = {index[pos]: {k: v.cpu() if torch.is_tensor(v) else v for k, v in state[index[pos]].items()}
                    for pos in domain.by_rank[domain.rank] if index[pos] in state}
            everyone: List[Optional[dict]] = [None] * len(domain.by_rank)
            dist.all_gather_object(everyone, mine, group=domain.group)
            for r, theirs in enumerate(everyone):
                if r != domain.rank:
                    merged.update(theirs or {})
        return {k: merged[k] for k in sorted(merged)}

    def prune_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the loaded state of the parameters other ranks own."""
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if (g, i) not in self.owned:
                    optimizer.state.pop(p, None)


def _flat_indices(param_groups: List[dict]) -> Dict[Position, int]:
    """torch's state_dict numbering: params counted over the groups in order."""
    index, n = {}, 0
    for g, group in enumerate(param_groups):
        for i in range(len(group["params"])):
            index[(g, i)] = n
            n += 1
    return index
