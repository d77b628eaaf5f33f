"""Data-parallel model wrappers: Megatron's "local" DDP and a thin `--DDP-impl torch` wrapper.

Local DDP keeps one contiguous gradient buffer per dtype (fp32 when accumulating/all-reducing in fp32); every
param gets `param.main_grad`, a view into it. A post-accumulate-grad hook adds each fresh `param.grad` into
`main_grad` and frees `param.grad`, so micro-batches accumulate in the buffer. After the last micro-batch
`allreduce_gradients()` averages the buffer over the data-parallel group in one collective per dtype.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _group_size(group) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class GradBuffer:
    """A flat, zero-initialised gradient buffer; `get(shape, start)` returns a view of it."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel = numel
        self.dtype = dtype
        self.data = torch.zeros(numel, dtype=dtype, device=device)

    def zero(self) -> None:
        self.data.zero_()

    def get(self, shape: torch.Size, start_index: int) -> torch.Tensor:
        end_index = start_index + shape.numel()
        if end_index > self.numel:
            raise RuntimeError(f"grad buffer view [{start_index}:{end_index}] is out of range ({self.numel})")
        return self.data[start_index:end_index].view(shape)


class _DDPBase(torch.nn.Module):
    """Forwards calls and unknown attributes (set_input_tensor, shared_embedding_or_output_weight, ...) to module."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules:
                return getattr(modules["module"], name)
            raise

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(self, *args, **kwargs):
        inner = self.module
        if hasattr(inner, "state_dict_for_save_checkpoint"):
            return inner.state_dict_for_save_checkpoint(*args, **kwargs)
        return inner.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)


class DistributedDataParallel(_DDPBase):
    """Megatron's local DDP (`--DDP-impl local`)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        dp_group=None,
        accumulate_allreduce_grads_in_fp32: bool = False,
        use_contiguous_buffers: bool = True,
    ) -> None:
        super().__init__(module)
        self.dp_group = dp_group
        self.accumulate_allreduce_grads_in_fp32 = accumulate_allreduce_grads_in_fp32
        self.use_contiguous_buffers = use_contiguous_buffers
        self._grad_buffers: Optional[Dict[torch.dtype, GradBuffer]] = None
        self._hook_handles: List = []
        if use_contiguous_buffers:
            self._build_buffers()

    def _params(self) -> Iterator[torch.nn.Parameter]:
        return (p for p in self.module.parameters() if p.requires_grad)

    def _buffer_dtype(self, param: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.accumulate_allreduce_grads_in_fp32 else param.dtype

    def _build_buffers(self) -> None:
        numels: Dict[torch.dtype, int] = {}
        devices: Dict[torch.dtype, torch.device] = {}
        for param in self._params():
            dtype = self._buffer_dtype(param)
            numels[dtype] = numels.get(dtype, 0) + param.numel()
            devices.setdefault(dtype, param.device)
        self._grad_buffers = {dtype: GradBuffer(n, dtype, devices[dtype]) for dtype, n in numels.items()}
        # Backward visits params roughly in reverse order, so lay them out back to front (as Megatron does).
        for param in self._params():
            dtype = self._buffer_dtype(param)
            numels[dtype] -= param.numel()
            param.main_grad = self._grad_buffers[dtype].get(param.shape, numels[dtype])
            self._hook_handles.append(param.register_post_accumulate_grad_hook(self._accumulate_hook))

    @staticmethod
    def _accumulate_hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        main_grad = param.main_grad
        # The FP32 optimizer points param.grad at main_grad; autograd then already accumulated in place.
        if grad.data_ptr() != main_grad.data_ptr():
            main_grad.add_(grad.data)
        param.grad = None

    @property
    def grad_buffers(self) -> Optional[Dict[torch.dtype, GradBuffer]]:
        return self._grad_buffers

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers (call once per iteration before the first micro-batch)."""
        if self._grad_buffers is not None:
            for buffer in self._grad_buffers.values():
                buffer.zero()
        else:
            for param in self._params():
                param.grad = None
                param.main_grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients are only reduced by allreduce_gradients(); nothing to suppress."""
        yield

    def allreduce_gradients(self) -> None:
        """Average gradients over the data-parallel group (sum / dp_size)."""
        dp_size = _group_size(self.dp_group)
        if self._grad_buffers is not None:
            for buffer in self._grad_buffers.values():
                if dp_size > 1:
                    buffer.data /= dp_size
                    dist.all_reduce(buffer.data, group=self.dp_group)
            return
        buckets: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
        for param in self._params():
            if param.grad is not None:
                buckets.setdefault(param.grad.dtype, []).append(param)
                param.main_grad = param.grad
        if dp_size == 1:
            return
        for params in buckets.values():
            grads = [p.grad.data for p in params]
            coalesced = _flatten_dense_tensors(grads)
            coalesced /= dp_size
            dist.all_reduce(coalesced, group=self.dp_group)
            for buf, synced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
                buf.copy_(synced)

    def broadcast_params(self) -> None:
        """Make every data-parallel rank start from dp-rank 0's weights."""
        if _group_size(self.dp_group) == 1:
            return
        src = dist.get_global_rank(self.dp_group, 0)
        for param in self.module.parameters():
            dist.broadcast(param.data, src=src, group=self.dp_group)


class TorchDistributedDataParallel(_DDPBase):
    """`--DDP-impl torch`: torch.nn.parallel.DistributedDataParallel behind the local DDP's interface.

    Gradients are averaged during backward (use `no_sync()` on all but the last micro-batch to reduce once);
    `allreduce_gradients()` is therefore a no-op, and grads stay in `param.grad`.
    """

    def __init__(self, module: torch.nn.Module, *, dp_group=None, **ddp_kwargs) -> None:
        super().__init__(module)
        self.dp_group = dp_group
        self._ddp: Optional[torch.nn.parallel.DistributedDataParallel] = None
        if _group_size(dp_group) > 1:
            device_ids = None
            first = next(module.parameters(), None)
            if first is not None and first.is_cuda:
                device_ids = [first.device.index]
            # Keep the DDP object outside the module tree so parameter names stay "module.<name>".
            object.__setattr__(self, "_ddp", torch.nn.parallel.DistributedDataParallel(
                module, device_ids=device_ids, process_group=dp_group, **ddp_kwargs
            ))

    def forward(self, *inputs, **kwargs):
        if self._ddp is not None:
            return self._ddp(*inputs, **kwargs)
        return self.module(*inputs, **kwargs)

    def no_sync(self):
        return self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()

    def allreduce_gradients(self) -> None:
        pass

    def zero_grad_buffer(self) -> None:
        for param in self.module.parameters():
            param.grad = None
