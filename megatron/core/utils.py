"""Small helpers shared by the parallel core: exact division with clear errors, viewless tensors, model unwrapping,
and switching sequence parallelism off for inference (`sequence_parallel_off`).

Nothing here touches process groups or global arguments.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def ensure_divisibility(numerator: int, denominator: int, what: str = "") -> None:
    """Raise a one-line ValueError unless `denominator` divides `numerator`."""
    if denominator == 0 or numerator % denominator != 0:
        label = f"{what}: " if what else ""
        raise ValueError(f"{label}{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """`numerator // denominator`, raising a clear ValueError when it does not divide exactly."""
    ensure_divisibility(numerator, denominator, what)
    return numerator // denominator


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """Return a tensor sharing `inp`'s storage but with no `._base` (so the view's parent can be freed).

    Megatron uses this for pipeline outputs whose storage is later deallocated; with `keep_graph` the result stays
    in the autograd graph (through a trivial view op), otherwise it is a detached alias.
    """
    if inp._base is None:
        return inp
    if keep_graph:
        return _MakeViewless.apply(inp)
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class _MakeViewless(torch.autograd.Function):
    """Identity in autograd whose output shares storage with the input but is not a view of it."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor) -> torch.Tensor:
        out = torch.empty((1,), dtype=inp.dtype, device=inp.device)
        out.data = inp.data
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output


def safely_set_viewless_tensor_data(tensor: torch.Tensor, new_data_tensor: torch.Tensor) -> None:
    """Replace `tensor.data` (used to free pipeline activations); refuses views, whose data cannot be swapped."""
    if tensor._base is not None:
        raise RuntimeError("safely_set_viewless_tensor_data: tensor is a view; make it viewless first")
    tensor.data = new_data_tensor


def get_attr_wrapped_model(model: Any, attr: str, allow_none: bool = True) -> Any:
    """Look up `attr` on `model`, unwrapping `.module` layers (DDP, Float16Module) until it is found."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("get_attr_wrapped_model: expected a single model chunk")
        model = model[0]
    while not hasattr(model, attr) or (not allow_none and getattr(model, attr) is None):
        if not hasattr(model, "module"):
            raise RuntimeError(f"couldn't find attribute {attr!r} on the model or any wrapped module")
        model = model.module
    return getattr(model, attr)


def unwrap_model(model: Any, module_instances: tuple = ()) -> Any:
    """Strip wrappers (DDP, Float16Module, DeepSpeed's engine: anything whose `.module` is a torch module; only
    `module_instances` when given) from a model or a list of model chunks (keeps list-ness). The project's one
    unwrapping helper: megatron.utils.unwrap_model and megatron.model.unwrap_model are this function."""
    return_list = isinstance(model, list)
    out = []
    for m in (model if return_list else [model]):
        while isinstance(getattr(m, "module", None), torch.nn.Module) and (
                not module_instances or isinstance(m, module_instances)):
            m = m.module
        out.append(m)
    return out if return_list else out[0]


@contextlib.contextmanager
def sequence_parallel_off(model: Any) -> Iterator[None]:
    """Run `model` without the sequence split inside the block (what Megatron's inference does for generation).

    Every submodule attribute ``sequence_parallel`` that is True, and ``config.sequence_parallel`` of every config
    the modules hold, is set to False and restored on exit. The layers then run as plain tensor parallelism: each TP
    rank holds the whole sequence, so a prompt or a one-token decoding step of any length works, and the numbers
    are those of TP without SP (the weights do not depend on SP). Parameters' own ``sequence_parallel`` marks (for
    gradient reduction) are left alone. Not for training: the grads of SP-marked parameters would be reduced twice.
    """
    chunks = model if isinstance(model, list) else [model]
    flipped: list[Any] = []
    seen: set[int] = set()
    for chunk in chunks:
        for module in chunk.modules():
            for obj in (module, getattr(module, "config", None)):
                if obj is not None and id(obj) not in seen and getattr(obj, "sequence_parallel", None) is True:
                    seen.add(id(obj))
                    flipped.append(obj)
    for obj in flipped:
        obj.sequence_parallel = False
    try:
        yield
    finally:
        for obj in flipped:
            obj.sequence_parallel = True


def flatten_dense_tensors(tensors: Any) -> torch.Tensor:
    """One flat 1-D tensor holding `tensors` back to back (torch's coalescing helper, used for bucketed all-reduce)."""
    return torch._utils._flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat: torch.Tensor, tensors: Any) -> tuple:
    """Views of `flat` shaped like `tensors` (the inverse of `flatten_dense_tensors`)."""
    return torch._utils._unflatten_dense_tensors(flat, tensors)
