"""Named RNG streams for model parallelism and activation recomputation that replays them exactly.

`RNGStatesTracker` follows Megatron's CudaRNGStatesTracker: `add(name, seed)` registers a stream and
`fork(name)` runs a block with that stream's generator state swapped in (and saves where the stream got to).
It swaps the CPU generator *and*, when CUDA is available, the current CUDA generator, so dropout draws from the
stream whichever device the tensors live on.

`model_parallel_manual_seed(seed, tp_rank)` (Megatron's model_parallel_cuda_manual_seed): the default generator
gets `seed` (identical across TP ranks, so dropout outside the fork matches on all TP ranks) and the stream
"model-parallel-rng" gets `seed + 2718 + tp_rank` (differs across TP ranks: dropout inside attention on
sharded heads). Any pipeline offset (Megatron: seed + 100 * pp_rank) is applied by the caller first.

`checkpoint(function, distribute_saved_activations, *args)` recomputes `function` during backward with the CPU,
CUDA and tracker RNG states it saw in forward, so dropout masks in the recomputation equal the original ones.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import group_size
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"  # unused by Megatron GPT; kept for name compatibility


def _cuda_ready() -> bool:
    return torch.cuda.is_available()


def get_device_rng_state() -> Dict[str, Optional[torch.Tensor]]:
    """Snapshot of the CPU generator and (if available) the current CUDA generator."""
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if _cuda_ready() else None,
    }


def set_device_rng_state(state: Dict[str, Optional[torch.Tensor]]) -> None:
    """Restore a snapshot taken by `get_device_rng_state` (a CUDA part is ignored without CUDA)."""
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and _cuda_ready():
        torch.cuda.set_rng_state(state["cuda"])


def _seed_device_generators(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    if _cuda_ready():
        torch.cuda.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states; `fork(name)` swaps one in for the duration of a `with` block."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: Dict[str, Dict[str, Optional[torch.Tensor]]] = {}
        self.seeds_: set = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> Dict[str, Dict[str, Optional[torch.Tensor]]]:
        """A copy of every stream's state (for checkpoints)."""
        return {name: dict(state) for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, Any]) -> None:
        """Replace the streams (from `get_states()`; a bare tensor is taken as a CUDA-style single state)."""
        converted = {}
        for name, state in states.items():
            if isinstance(state, torch.Tensor):  # a Megatron checkpoint stores one (CUDA) ByteTensor per name
                is_cpu_state = state.numel() == torch.get_rng_state().numel()
                state = {"cpu": state, "cuda": None} if is_cpu_state else {"cpu": None, "cuda": state}
            converted[name] = dict(state)
        self.states_ = converted

    def add(self, name: str, seed: int) -> None:
        """Register stream `name` seeded with `seed`; duplicate names or seeds are errors (as in Megatron)."""
        if seed in self.seeds_:
            raise RuntimeError(f"RNG seed {seed} already exists in the tracker")
        if name in self.states_:
            raise RuntimeError(f"RNG state {name!r} already exists in the tracker")
        self.seeds_.add(seed)
        saved = get_device_rng_state()
        try:
            _seed_device_generators(seed)
            self.states_[name] = get_device_rng_state()
        finally:
            set_device_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with stream `name`; its advanced state is kept for next time."""
        if name not in self.states_:
            raise RuntimeError(
                f"RNG state {name!r} is not in the tracker; call model_parallel_manual_seed(seed, tp_rank) "
                f"(megatron.initialize does this) before building or running the model"
            )
        saved = get_device_rng_state()
        stream = self.states_[name]
        _set_partial_state(stream)
        try:
            yield
        finally:
            self.states_[name] = _merge_state(stream, get_device_rng_state())
            set_device_rng_state(saved)


def _set_partial_state(state: Dict[str, Optional[torch.Tensor]]) -> None:
    if state.get("cpu") is not None:
        torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and _cuda_ready():
        torch.cuda.set_rng_state(state["cuda"])


def _merge_state(stream: Dict[str, Optional[torch.Tensor]], now: Dict[str, Optional[torch.Tensor]]) -> Dict:
    """The stream's new state: only the parts the stream owns (a CUDA-only state stays CUDA-only)."""
    return {key: (now[key] if stream.get(key) is not None else None) for key in ("cpu", "cuda")}


_RNG_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The per-process tracker."""
    return _RNG_TRACKER


get_cuda_rng_tracker = get_rng_tracker  # Megatron's name


def model_parallel_manual_seed(seed: int, tp_rank: Optional[int] = None, pp_rank: int = 0) -> None:
    """Seed the default generators with `seed` and register "model-parallel-rng" = seed + 2718 + tp_rank.

    `tp_rank` defaults to the current parallel state's rank (0 when none). `pp_rank` is accepted for symmetry;
    Megatron applies the pipeline offset (seed + 100 * pp_rank) before calling this, and so must the caller.
    """
    del pp_rank
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tensor_model_parallel_seed = seed + 2718 + tp_rank
    _seed_device_generators(seed)
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)


def model_parallel_cuda_manual_seed(seed: int, tp_rank: Optional[int] = None) -> None:
    """Megatron's name for `model_parallel_manual_seed`."""
    model_parallel_manual_seed(seed, tp_rank)


# ---- activation recomputation ---------------------------------------------------------------------------------
class CheckpointFunction(torch.autograd.Function):
    """Run `function` without saving activations; rerun it in backward with the forward's RNG states.

    A dummy input that requires grad is always passed in, so the output joins the autograd graph even when no
    real input requires grad (e.g. the first layer over embeddings of frozen weights): parameter gradients of
    `function` are still produced.
    """

    @staticmethod
    def forward(ctx: Any, function: Callable, distribute: bool, tp_group: Any, _dummy: torch.Tensor, *args: Any):
        ctx.function = function
        ctx.distribute = bool(distribute and group_size(tp_group) > 1 and args and isinstance(args[0], torch.Tensor))
        ctx.tp_group = tp_group
        ctx.fwd_rng = get_device_rng_state()
        ctx.fwd_tracker = _RNG_TRACKER.get_states()
        ctx.autocast = _autocast_state()
        with torch.no_grad():
            outputs = function(*args)

        tensor_idx, tensors, others = [], [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                tensor_idx.append(i)
                tensors.append(a)
                others.append(None)
            else:
                others.append(a)
        if ctx.distribute:
            ctx.first_shape = args[0].shape
            tensors[0] = split_tensor_into_1d_equal_chunks(args[0].detach(), tp_group, new_buffer=True)
        ctx.tensor_idx = tensor_idx
        ctx.others = others
        ctx.requires = [a.requires_grad if isinstance(a, torch.Tensor) else False for a in args]
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() recomputation needs .backward(), not torch.autograd.grad()")
        saved = list(ctx.saved_tensors)
        if ctx.distribute:
            saved[0] = gather_split_1d_tensor(saved[0], ctx.tp_group).view(ctx.first_shape)
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_idx, saved):
            d = t.detach()
            d.requires_grad_(ctx.requires[i])
            args[i] = d

        bwd_rng = get_device_rng_state()
        bwd_tracker = _RNG_TRACKER.get_states()
        set_device_rng_state(ctx.fwd_rng)
        _RNG_TRACKER.set_states(ctx.fwd_tracker)
        try:
            with torch.enable_grad(), _autocast_context(ctx.autocast):
                outputs = ctx.function(*args)
        finally:
            set_device_rng_state(bwd_rng)
            _RNG_TRACKER.set_states(bwd_tracker)

        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [
            (o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if isinstance(a, torch.Tensor) and ctx.requires[i] else None
                            for i, a in enumerate(args))
        return (None, None, None, None) + input_grads


def _autocast_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"cpu": torch.is_autocast_enabled("cpu"), "cpu_dtype": torch.get_autocast_dtype("cpu")}
    if _cuda_ready():
        state["cuda"] = torch.is_autocast_enabled("cuda")
        state["cuda_dtype"] = torch.get_autocast_dtype("cuda")
    return state


@contextlib.contextmanager
def _autocast_context(state: Dict[str, Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if state.get("cpu"):
            stack.enter_context(torch.autocast("cpu", dtype=state["cpu_dtype"]))
        if state.get("cuda"):
            stack.enter_context(torch.autocast("cuda", dtype=state["cuda_dtype"]))
        yield


_CHECKPOINT_OVERRIDE: Optional[Callable[..., Any]] = None


def set_checkpoint_function(fn: Optional[Callable[..., Any]]) -> None:
    """Route `checkpoint()` to `fn(function, *args)` (DeepSpeed's activation checkpointing); None restores ours."""
    global _CHECKPOINT_OVERRIDE
    _CHECKPOINT_OVERRIDE = fn


def checkpoint(function: Callable, distribute_saved_activations: bool, *args: Any, tp_group: Any = None) -> Any:
    """Activation recomputation: `function(*args)` now without keeping activations, again in backward.

    With `distribute_saved_activations` and a `tp_group` of size > 1, the first argument is stored split across
    the TP ranks (1/tp of the memory) and all-gathered before recomputation. After `set_checkpoint_function(fn)`
    (--deepspeed-activation-checkpointing) the recomputation is `fn`'s, which handles partitioning itself.
    """
    if _CHECKPOINT_OVERRIDE is not None:
        return _CHECKPOINT_OVERRIDE(function, *args)
    dummy = torch.empty((0,), requires_grad=True)
    return CheckpointFunction.apply(function, distribute_saved_activations, tp_group, dummy, *args)
