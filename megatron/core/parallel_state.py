"""Process groups for tensor, context, pipeline and data parallelism, laid out exactly as Megatron-LM lays them out.

Rank layout (Megatron's order tp-cp-dp-pp: TP groups are runs of contiguous ranks, then CP, then DP, then PP)::

    global_rank = pp_rank * (tp_size * cp_size * dp_size) + dp_rank * (tp_size * cp_size) + cp_rank * tp_size + tp_rank

Context parallelism (CP) splits the sequence; it does not shard weights, so gradients are reduced (and the
distributed optimizer shards its state) over the data-parallel-with-context-parallel group `dp_cp_group` (the ranks
with the same TP and PP coordinates), while data loading and loss averaging use the plain `dp_group`.

`initialize_model_parallel(tp, pp, vpp)` builds every group (all ranks must call it, in the same order) and returns
a `ParallelState` that layers and schedules receive explicitly. The last one built is also kept as the "current"
state for entry scripts (`get_parallel_state()`), together with Megatron-style module functions
(`get_tensor_model_parallel_group()`, `get_data_parallel_rank()`, ...).  A group of None means "no communication";
`ParallelState.single()` describes one process without torch.distributed.

Expert parallelism (Megatron-LM core's expert grid, order tp-ep-dp-pp): within a pipeline stage the ranks are
numbered again as ``stage_rank = edp_rank * (etp * ep) + ep_rank * etp + etp_rank`` with etp the expert-tensor-parallel
size (--expert-tensor-parallel-size, default TP) and edp = (TP x DP) / (etp x ep). The experts' linear layers are
split over the expert-tensor-parallel group, the experts over the expert-model-parallel group, and expert grads are
reduced over the expert-data-parallel group. With etp = TP this is: the EP ranks of a rank are `ep` consecutive
data-parallel ranks of its (TP rank, PP stage), dp_rank = edp_rank * ep + ep_rank and edp = dp / ep.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch.distributed as dist

Group = Any  # torch.distributed.ProcessGroup or None


def _build_rank_groups(world_size: int, tp: int, pp: int,
                       split_rank: Optional[int] = None, cp: int = 1, ep: int = 1,
                       etp: Optional[int] = None) -> Dict[str, List[List[int]]]:
    """Pure rank layout: the rank lists of every TP/DP/PP/model-parallel/embedding group (no processes needed).

    With a pipeline split rank R (encoder-and-decoder models, Megatron 23.06's --pipeline-model-parallel-split-rank)
    the word-embedding group is {first, R, last} (the decoder's embedding lives on stage R) and the
    position-embedding group is {first, R}. Returns a dict with keys "tp", "cp", "dp", "dp_cp", "pp", "mp", "embedding",
    "position_embedding"; each is a list of groups, each group a list of global ranks. Raises ValueError for
    impossible layouts.
    """
    # port of Megatron's initialize_model_parallel rank layout (its group-building loops)
    if tp < 1 or pp < 1 or cp < 1:
        raise ValueError(
            f"--tensor-model-parallel-size ({tp}), --pipeline-model-parallel-size ({pp}) and "
            f"--context-parallel-size ({cp}) must be >= 1"
        )
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size ({world_size}) is not divisible by tensor-model-parallel size ({tp}) x "
            f"pipeline-model-parallel size ({pp}) x context-parallel size ({cp}); launch a multiple of "
            f"{tp * pp * cp} processes or change --tensor-model-parallel-size/--pipeline-model-parallel-size/"
            f"--context-parallel-size"
        )
    dp = world_size // (tp * pp * cp)
    stage = tp * cp * dp  # ranks per pipeline stage

    def rank(p: int, d: int, c: int, t: int) -> int:
        return p * stage + d * tp * cp + c * tp + t

    tp_groups = [list(range(start, start + tp)) for start in range(0, world_size, tp)]
    cp_groups = [[rank(p, d, c, t) for c in range(cp)] for p in range(pp) for d in range(dp) for t in range(tp)]
    dp_groups = [[rank(p, d, c, t) for d in range(dp)] for p in range(pp) for c in range(cp) for t in range(tp)]
    dp_cp_groups = [sorted(rank(p, d, c, t) for d in range(dp) for c in range(cp)) for p in range(pp)
                    for t in range(tp)]
    pp_groups = [list(range(r, world_size, stage)) for r in range(stage)]
    mp_groups = [sorted(rank(p, d, c, t) for p in range(pp) for t in range(tp)) for d in range(dp)
                 for c in range(cp)]
    if split_rank is not None and pp > 1 and not 0 < split_rank < pp:
        raise ValueError(f"--pipeline-model-parallel-split-rank ({split_rank}) must be in 1..{pp - 1} "
                         f"(--pipeline-model-parallel-size {pp}): the first decoder stage")
    emb_groups = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp_groups]
    pos_groups = [[g[0]] for g in pp_groups]
    if split_rank is not None and pp > 1:
        emb_groups = [sorted({g[0], g[split_rank], g[-1]}) for g in pp_groups]
        pos_groups = [[g[0], g[split_rank]] for g in pp_groups]
    etp = tp if etp is None else etp
    if etp == tp and (ep < 1 or dp % ep):
        raise ValueError(f"--expert-model-parallel-size ({ep}) must divide the data-parallel size ({dp} = world size "
                         f"{world_size} / (TP {tp} x PP {pp})); launch a multiple of {tp * pp * ep} processes")
    if etp < 1 or ep < 1 or (tp * dp) % (etp * ep):
        raise ValueError(f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) must divide "
                         f"the ranks of a pipeline stage ({tp * dp} = TP {tp} x DP {dp}); launch a multiple of "
                         f"{etp * ep * pp} processes")
    if etp != tp and cp > 1:
        raise ValueError("--expert-tensor-parallel-size different from --tensor-model-parallel-size with "
                         "--context-parallel-size > 1 is not implemented")
    edp = tp * dp // (etp * ep)

    def expert_rank(p: int, d: int, e: int, t: int) -> int:  # Megatron-LM core's expert grid (tp-ep-dp-pp)
        return p * stage + d * etp * ep + e * etp + t

    if etp == tp:  # the same grid, from the data-parallel groups (which skip the context-parallel ranks)
        ep_groups = [g[i:i + ep] for g in dp_groups for i in range(0, dp, ep)]
        edp_groups = [g[e::ep] for g in dp_groups for e in range(ep)]
        etp_groups = tp_groups
    else:
        ep_groups = [[expert_rank(p, d, e, t) for e in range(ep)] for p in range(pp) for d in range(edp)
                     for t in range(etp)]
        edp_groups = [[expert_rank(p, d, e, t) for d in range(edp)] for p in range(pp) for e in range(ep)
                      for t in range(etp)]
        etp_groups = [[expert_rank(p, d, e, t) for t in range(etp)] for p in range(pp) for d in range(edp)
                      for e in range(ep)]
    return {
        "tp": tp_groups,
        "cp": cp_groups,
        "dp": dp_groups,
        "dp_cp": dp_cp_groups,
        "pp": pp_groups,
        "mp": mp_groups,
        "embedding": emb_groups,
        "position_embedding": pos_groups,
        "ep": ep_groups,
        "edp": edp_groups,
        "etp": etp_groups,
    }


def expert_coordinates(global_rank: int, world_size: int, tp: int, pp: int, ep: int, etp: int) -> Dict[str, int]:
    """(etp_rank, ep_rank, edp_rank) of `global_rank` in Megatron-LM core's expert grid (no context parallelism)."""
    stage_rank = global_rank % (world_size // pp)
    return {"etp_rank": stage_rank % etp, "ep_rank": (stage_rank // etp) % ep, "edp_rank": stage_rank // (etp * ep)}


def checkpoint_writer(global_rank: int, world_size: int, tp: int, pp: int, ep: int, etp: int) -> bool:
    """Whether this rank writes its folder mp_rank_TT[_PPP][_EEE]: the lowest rank of its stage with its (TP rank,
    expert rank). That is expert-data-parallel rank 0 (Megatron-LM's rule) when etp = TP or every (TP rank, expert
    rank) has its own such rank; with etp = 1 < TP also the TP ranks Megatron-LM's rule would leave unwritten."""
    stage = world_size // pp
    local = global_rank % stage

    def key(r: int) -> tuple:
        return r % tp, (r // etp) % ep

    return all(key(r) != key(local) for r in range(local))


def rank_coordinates(global_rank: int, world_size: int, tp: int, pp: int, cp: int = 1) -> Dict[str, int]:
    """(tp_rank, cp_rank, dp_rank, pp_rank) of `global_rank` under Megatron's layout."""
    dp = world_size // (tp * pp * cp)
    return {
        "tp_rank": global_rank % tp,
        "cp_rank": (global_rank // tp) % cp,
        "dp_rank": (global_rank // (tp * cp)) % dp,
        "pp_rank": global_rank // (tp * cp * dp),
    }


@dataclass
class ParallelState:
    """Every process group and coordinate of this rank. Groups are None when torch.distributed is not used."""

    tp_group: Group = None
    pp_group: Group = None
    dp_group: Group = None
    mp_group: Group = None
    embedding_group: Group = None
    position_embedding_group: Group = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    world_size: int = 1
    global_rank: int = 0
    virtual_pp_rank: Optional[int] = None
    virtual_pp_size: Optional[int] = None
    pp_ranks: List[int] = field(default_factory=lambda: [0])
    tp_ranks: List[int] = field(default_factory=lambda: [0])
    dp_ranks_: List[int] = field(default_factory=lambda: [0])
    embedding_ranks: List[int] = field(default_factory=lambda: [0])
    position_embedding_ranks: List[int] = field(default_factory=lambda: [0])
    pipeline_split_rank: Optional[int] = None  # first decoder stage of an encoder-and-decoder model (T5)
    ep_group: Group = None  # expert model parallel: `ep_size` consecutive data-parallel ranks
    edp_group: Group = None  # expert data parallel: the data-parallel ranks holding the same experts
    ep_rank: int = 0
    ep_size: int = 1
    edp_rank: int = 0
    edp_size: int = 1
    # context parallelism: the sequence is split over cp_group; gradients are reduced over dp_cp_group
    cp_group: Group = None
    cp_rank: int = 0
    cp_size: int = 1
    cp_ranks: List[int] = field(default_factory=lambda: [0])
    # expert tensor parallelism (--expert-tensor-parallel-size): the group the experts' linear layers are split over;
    # a size of None means the TP group's (Megatron-LM's default)
    etp_group: Group = None
    etp_rank: Optional[int] = None
    etp_size: Optional[int] = None
    writes_checkpoint: Optional[bool] = None  # this rank writes its checkpoint folder (see checkpoint_writer)
    dp_cp_group_: Group = None
    dp_cp_ranks: List[int] = field(default_factory=lambda: [0])

    @property
    def dp_cp_group(self) -> Group:
        """The data-parallel group including the context-parallel ranks (gradient reduction, distributed
        optimizer); the plain data-parallel group without context parallelism."""
        return self.dp_group if self.cp_size == 1 else self.dp_cp_group_

    @property
    def expert_tp_differs(self) -> bool:
        """Whether the experts are split over an expert-tensor-parallel group other than the TP group."""
        return self.etp_size is not None and self.etp_size != self.tp_size

    @property
    def expert_groups(self) -> bool:
        """Whether expert params have groups of their own (EP > 1 or expert-TP != TP): their grads are reduced over
        `edp_group`, and counted in the grad norm over `ep_group` (and `etp_group`)."""
        return self.ep_size > 1 or self.expert_tp_differs

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    def forward_only_shard(self) -> tuple[int, int]:
        """(index, count) for splitting forward-only work (evaluation, scoring) over the data-parallel ranks.

        Data-parallel ranks that share an expert-parallel or expert-tensor-parallel group meet in every MoE layer's
        collectives, so they must run the same batches: they get the same index (blocks of lcm(TP, ETP x EP) ranks
        of a stage). Without expert groups this is (dp_rank, dp_size). Sums over the data-parallel group then count
        each shard dp_size / count times.
        """
        if not self.expert_groups:
            return self.dp_rank, self.dp_size
        block = math.lcm(self.tp_size, (self.etp_size or self.tp_size) * self.ep_size) // self.tp_size
        return self.dp_rank // block, self.dp_size // block

    @classmethod
    def single(cls) -> ParallelState:
        """State for one process without torch.distributed: all groups None, all sizes 1."""
        return cls()

    # ---- pipeline helpers -------------------------------------------------------------------------------------
    def is_pipeline_first_stage(self, ignore_virtual: bool = False) -> bool:
        if not ignore_virtual and self.virtual_pp_size is not None and self.virtual_pp_rank != 0:
            return False
        return self.pp_rank == 0

    def is_pipeline_last_stage(self, ignore_virtual: bool = False) -> bool:
        if (
            not ignore_virtual
            and self.virtual_pp_size is not None
            and self.virtual_pp_rank != self.virtual_pp_size - 1
        ):
            return False
        return self.pp_rank == self.pp_size - 1

    def pp_next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    def pp_prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    def pp_first_rank(self) -> int:
        return self.pp_ranks[0]

    def pp_last_rank(self) -> int:
        return self.pp_ranks[-1]

    def is_rank_in_embedding_group(self, ignore_virtual: bool = False) -> bool:
        """Megatron semantics: with virtual stages only the first chunk of the first stage / last chunk of the last."""
        if self.global_rank not in self.embedding_ranks:
            return False
        if ignore_virtual:
            return True
        if self.global_rank == self.embedding_ranks[0]:
            return self.is_pipeline_first_stage()
        if self.global_rank == self.embedding_ranks[-1]:
            return self.is_pipeline_last_stage()
        return True

    def is_rank_in_position_embedding_group(self) -> bool:
        return self.global_rank in self.position_embedding_ranks

    # ---- encoder-and-decoder split (Megatron 23.06: stages < R run the encoder, stages >= R the decoder) --------
    def is_pipeline_stage_before_split(self, rank: Optional[int] = None) -> bool:
        """True on an encoder stage (always true without a split or without pipelining)."""
        if self.pp_size == 1 or self.pipeline_split_rank is None:
            return True
        return (self.pp_rank if rank is None else rank) < self.pipeline_split_rank

    def is_pipeline_stage_after_split(self, rank: Optional[int] = None) -> bool:
        """True on a decoder stage (always true without a split or without pipelining)."""
        if self.pp_size == 1 or self.pipeline_split_rank is None:
            return True
        return (self.pp_rank if rank is None else rank) >= self.pipeline_split_rank

    def is_pipeline_stage_at_split(self) -> bool:
        """True on the last encoder stage (the next stage runs the decoder)."""
        return self.is_pipeline_stage_before_split() and self.is_pipeline_stage_after_split(self.pp_rank + 1)

    # ---- TP / DP helpers --------------------------------------------------------------------------------------
    def tp_src_rank(self) -> int:
        """Global rank of tp_rank 0 in my TP group (broadcast source for data)."""
        return self.tp_ranks[0]

    def dp_src_rank(self) -> int:
        return self.dp_ranks_[0]

    def dp_ranks(self) -> List[int]:
        """Global ranks of my data-parallel group, by dp_rank."""
        return list(self.dp_ranks_)

    def set_virtual_pipeline_model_parallel_rank(self, rank: Optional[int]) -> None:
        self.virtual_pp_rank = rank


_STATE: Optional[ParallelState] = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    backend: Optional[str] = None,
    pipeline_model_parallel_split_rank: Optional[int] = None,
    timeout: Optional[timedelta] = None,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
) -> ParallelState:
    """Create all groups (collective: every rank calls it) and make the result the current state.

    `timeout` bounds every collective of the new groups (torch's default otherwise: 30 minutes for gloo, whatever
    init_process_group was given); initialize passes --distributed-timeout-minutes, as Megatron Core does."""
    # port of Megatron's initialize_model_parallel
    global _STATE
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed initialised first "
            "(call torch.distributed.init_process_group or megatron.initialize.initialize_megatron)"
        )
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    tp, pp, cp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size), int(context_parallel_size)
    split = pipeline_model_parallel_split_rank if pp > 1 else None
    ep = int(expert_model_parallel_size)
    etp = tp if expert_tensor_parallel_size is None else int(expert_tensor_parallel_size)
    if ep > 1 and cp > 1:
        raise ValueError("--expert-model-parallel-size > 1 with --context-parallel-size > 1 is not implemented")
    layout = _build_rank_groups(world_size, tp, pp, split, cp, ep, etp)
    expert_groups = ep > 1 or etp != tp
    if virtual_pipeline_model_parallel_size is not None:
        if pp <= 1:
            raise ValueError(
                "--num-layers-per-virtual-pipeline-stage (virtual pipeline) needs --pipeline-model-parallel-size > 1"
            )
        if virtual_pipeline_model_parallel_size < 1:
            raise ValueError(f"virtual pipeline size must be >= 1, got {virtual_pipeline_model_parallel_size}")

    mine: Dict[str, Any] = {}
    my_ranks: Dict[str, List[int]] = {}
    kinds = ("tp", "dp", "pp", "mp", "embedding", "position_embedding") + (("cp", "dp_cp") if cp > 1 else ()) + \
        (("ep", "edp", "etp") if expert_groups else ())
    for kind in kinds:
        for ranks in layout[kind]:
            group = dist.new_group(ranks, backend=backend, timeout=timeout)  # every rank creates every group, same order
            if rank in ranks:
                mine[kind] = group
                my_ranks[kind] = ranks
    coords = rank_coordinates(rank, world_size, tp, pp, cp)
    state = ParallelState(
        tp_group=mine["tp"],
        pp_group=mine["pp"],
        dp_group=mine["dp"],
        mp_group=mine["mp"],
        embedding_group=mine.get("embedding"),
        position_embedding_group=mine.get("position_embedding"),
        tp_rank=coords["tp_rank"],
        tp_size=tp,
        pp_rank=coords["pp_rank"],
        pp_size=pp,
        dp_rank=coords["dp_rank"],
        dp_size=world_size // (tp * pp * cp),
        world_size=world_size,
        global_rank=rank,
        virtual_pp_rank=0 if virtual_pipeline_model_parallel_size is not None else None,
        virtual_pp_size=virtual_pipeline_model_parallel_size,
        pp_ranks=my_ranks["pp"],
        tp_ranks=my_ranks["tp"],
        dp_ranks_=my_ranks["dp"],
        embedding_ranks=my_ranks.get("embedding", []),
        position_embedding_ranks=my_ranks.get("position_embedding", []),
        pipeline_split_rank=split,
        cp_group=mine.get("cp"),
        cp_rank=coords["cp_rank"],
        cp_size=cp,
        cp_ranks=my_ranks.get("cp", [rank]),
        dp_cp_group_=mine.get("dp_cp"),
        dp_cp_ranks=my_ranks.get("dp_cp", my_ranks["dp"]),
    )
    state.etp_group, state.etp_size, state.etp_rank = state.tp_group, tp, state.tp_rank
    if expert_groups:
        expert = expert_coordinates(rank, world_size, tp, pp, ep, etp)
        state.ep_group, state.edp_group, state.etp_group = mine["ep"], mine["edp"], mine["etp"]
        state.ep_size, state.ep_rank = ep, expert["ep_rank"]
        state.edp_size, state.edp_rank = world_size // (pp * ep * etp), expert["edp_rank"]
        state.etp_size, state.etp_rank = etp, expert["etp_rank"]
    state.writes_checkpoint = checkpoint_writer(rank, world_size, tp, pp, ep, etp) if expert_groups else \
        coords["dp_rank"] == 0
    _STATE = state
    return state


def set_parallel_state(state: Optional[ParallelState]) -> None:
    """Install `state` as the current one (tests; single-process runs use `ParallelState.single()`)."""
    global _STATE
    _STATE = state


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    """The current state; raises a clear error before `initialize_model_parallel`."""
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialised; call initialize_model_parallel first")
    return _STATE


def current_parallel_state(state: Optional[ParallelState] = None) -> ParallelState:
    """`state` when given, else the installed state, else `ParallelState.single()` (one process, no groups): the one
    fallback that library code uses when a caller may or may not have initialised model parallelism."""
    if state is not None:
        return state
    return _STATE if _STATE is not None else ParallelState.single()


def destroy_model_parallel() -> None:
    """Forget the current state (the process groups die with the default group)."""
    global _STATE
    _STATE = None


# ---- Megatron-style accessors on the current state -------------------------------------------------------------
def get_tensor_model_parallel_group() -> Group:
    return get_parallel_state().tp_group


def get_pipeline_model_parallel_group() -> Group:
    return get_parallel_state().pp_group


def get_data_parallel_group() -> Group:
    return get_parallel_state().dp_group


def get_model_parallel_group() -> Group:
    return get_parallel_state().mp_group


def get_embedding_group() -> Group:
    return get_parallel_state().embedding_group


def get_position_embedding_group() -> Group:
    return get_parallel_state().position_embedding_group


def get_context_parallel_group() -> Group:
    return get_parallel_state().cp_group


def get_context_parallel_world_size() -> int:
    return get_parallel_state().cp_size if _STATE is not None else 1


def get_context_parallel_rank() -> int:
    return get_parallel_state().cp_rank if _STATE is not None else 0


def get_data_parallel_group_with_context_parallel() -> Group:
    return get_parallel_state().dp_cp_group


def get_tensor_model_parallel_world_size() -> int:
    return get_parallel_state().tp_size if _STATE is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().tp_rank if _STATE is not None else 0


def get_pipeline_model_parallel_world_size() -> int:
    return get_parallel_state().pp_size if _STATE is not None else 1


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel_state().pp_rank if _STATE is not None else 0


def get_data_parallel_world_size() -> int:
    return get_parallel_state().dp_size if _STATE is not None else 1


def get_data_parallel_rank() -> int:
    return get_parallel_state().dp_rank if _STATE is not None else 0


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return get_parallel_state().virtual_pp_rank


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    get_parallel_state().set_virtual_pipeline_model_parallel_rank(rank)


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return get_parallel_state().virtual_pp_size


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    return get_parallel_state().is_pipeline_first_stage(ignore_virtual)


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    return get_parallel_state().is_pipeline_last_stage(ignore_virtual)


def get_pipeline_model_parallel_split_rank() -> Optional[int]:
    return get_parallel_state().pipeline_split_rank if _STATE is not None else None


def is_pipeline_stage_before_split(rank: Optional[int] = None) -> bool:
    return get_parallel_state().is_pipeline_stage_before_split(rank) if _STATE is not None else True


def is_pipeline_stage_after_split(rank: Optional[int] = None) -> bool:
    return get_parallel_state().is_pipeline_stage_after_split(rank) if _STATE is not None else True


def is_pipeline_stage_at_split() -> bool:
    return get_parallel_state().is_pipeline_stage_at_split()


def get_tensor_model_parallel_src_rank() -> int:
    return get_parallel_state().tp_src_rank()


def get_data_parallel_src_rank() -> int:
    return get_parallel_state().dp_src_rank()


def get_pipeline_model_parallel_first_rank() -> int:
    return get_parallel_state().pp_first_rank()


def get_pipeline_model_parallel_last_rank() -> int:
    return get_parallel_state().pp_last_rank()


def get_pipeline_model_parallel_next_rank() -> int:
    return get_parallel_state().pp_next_rank()


def get_pipeline_model_parallel_prev_rank() -> int:
    return get_parallel_state().pp_prev_rank()


# ---- expert parallelism (Megatron-LM core's names) -------------------------------------------------------------
def get_expert_model_parallel_group() -> Group:
    return get_parallel_state().ep_group


def get_expert_model_parallel_world_size() -> int:
    return get_parallel_state().ep_size if _STATE is not None else 1


def get_expert_model_parallel_rank() -> int:
    return get_parallel_state().ep_rank if _STATE is not None else 0


def get_expert_data_parallel_group() -> Group:
    """The expert-data-parallel group (the data-parallel group itself without expert parallelism)."""
    state = get_parallel_state()
    return state.edp_group if state.expert_groups else state.dp_group


def get_expert_data_parallel_world_size() -> int:
    state = get_parallel_state() if _STATE is not None else ParallelState.single()
    return state.edp_size if state.expert_groups else state.dp_size


def get_expert_data_parallel_rank() -> int:
    state = get_parallel_state() if _STATE is not None else ParallelState.single()
    return state.edp_rank if state.expert_groups else state.dp_rank


def get_expert_tensor_parallel_group() -> Group:
    return get_parallel_state().etp_group


def get_expert_tensor_parallel_world_size() -> int:
    state = current_parallel_state()
    return state.etp_size if state.etp_size is not None else state.tp_size


def get_expert_tensor_parallel_rank() -> int:
    state = current_parallel_state()
    return state.etp_rank if state.etp_rank is not None else state.tp_rank
