"""Data-parallel model wrappers: Megatron's "local" DDP and a thin `--DDP-impl torch` wrapper.

Local DDP keeps one contiguous gradient buffer per dtype (fp32 when accumulating/all-reducing in fp32); every
param gets `param.main_grad`, a view into it. A post-accumulate-grad hook adds each fresh `param.grad` into
`main_grad` and frees `param.grad`, so micro-batches accumulate in the buffer. After the last micro-batch
`finish_grad_sync()` (alias `allreduce_gradients()`) averages the buffer over the data-parallel group, one
collective per bucket (one bucket per dtype unless `--overlap-grad-reduce`). With `--overlap-grad-reduce` the
hook launches a bucket's collective asynchronously as soon as all its params have their grad of the last
micro-batch (the schedules run the other micro-batches under `no_sync()`), and `finish_grad_sync()` waits.
With `--use-distributed-optimizer` the buckets are reduce-scattered and the params are all-gathered after the step.
Under expert parallelism (`expert_dp_group`) the expert params (``param.allreduce is False``) get buffers of their
own, reduced (sharded) over the expert-data-parallel group; every grad is still divided by the full data-parallel
size (an expert's grad already sums the tokens of all its expert-parallel ranks), as Megatron-LM core does.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron.core.utils import flatten_dense_tensors, unflatten_dense_tensors

DEFAULT_BUCKET_SIZE = 40_000_000  # --ddp-bucket-size default (elements), as Megatron


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


class _Bucket:
    """A contiguous range [start, end) of one gradient buffer whose reduction is one collective.

    With the distributed optimizer `end - start` is padded to a multiple of the data-parallel size and data-parallel
    rank r owns the shard [start + r * shard_size, start + (r + 1) * shard_size)."""

    def __init__(self, index: int, key, start: int, end: int, params: List[torch.nn.Parameter],
                 group=None) -> None:
        self.index = index
        self.group = group  # the group this bucket is reduced (and, distributed optimizer, sharded) over
        self.group_size = _group_size(group)
        self.group_rank = dist.get_rank(group) if self.group_size > 1 else 0
        self.key = key
        self.start = start
        self.end = end
        self.params = params
        self.ready: set = set()
        self.launched = False
        self.handle = None  # async grad reduction
        self.shard_out: Optional[torch.Tensor] = None  # reduce-scatter output, copied into the buffer when done
        self.param_handle = None  # async param all-gather (distributed optimizer)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, dp_rank: Optional[int] = None, dp_size: Optional[int] = None) -> tuple:
        """This rank's shard of the bucket (by default over the bucket's own group)."""
        dp_rank = self.group_rank if dp_rank is None else dp_rank
        dp_size = self.group_size if dp_size is None else dp_size
        size = self.numel // dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


def _all_gather_into(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, shard, group=group, async_op=async_op)


class DistributedDataParallel(_DDPBase):
    """Megatron's local DDP (`--DDP-impl local`).

    Buckets: the buffer is split into buckets of about `bucket_size` elements (in backward order) when
    `overlap_grad_reduce` is on, otherwise one bucket per buffer. With `use_distributed_optimizer` each bucket is
    padded to a multiple of the data-parallel size and reduce-scattered instead of all-reduced; the model params then
    live in a parameter buffer with the gradient buffer's layout, so the updated shards can be all-gathered per bucket
    (`start_param_sync` / `finish_param_sync`, overlapped with the next forward when `overlap_param_gather`).
    The tied word embedding gets a bucket of its own there, so that the first and the last pipeline stage shard it
    identically and its cross-stage all-reduce after the reduce-scatter stays correct.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        dp_group=None,
        accumulate_allreduce_grads_in_fp32: bool = False,
        use_contiguous_buffers: bool = True,
        overlap_grad_reduce: bool = False,
        use_distributed_optimizer: bool = False,
        overlap_param_gather: bool = False,
        bucket_size: Optional[int] = None,
        expert_dp_group=None,
    ) -> None:
        super().__init__(module)
        if (overlap_grad_reduce or use_distributed_optimizer) and not use_contiguous_buffers:
            raise ValueError("--overlap-grad-reduce and --use-distributed-optimizer need contiguous gradient buffers "
                             "(drop --no-contiguous-buffers-in-local-ddp)")
        if overlap_param_gather and not use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
        if bucket_size is not None and bucket_size <= 0:
            raise ValueError(f"--ddp-bucket-size must be positive (got {bucket_size})")
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group  # None: expert params are reduced like the others
        self.dp_size = _group_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group) if self.dp_size > 1 else 0
        self.accumulate_allreduce_grads_in_fp32 = accumulate_allreduce_grads_in_fp32
        self.use_contiguous_buffers = use_contiguous_buffers
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather
        self.bucket_size = (bucket_size or DEFAULT_BUCKET_SIZE) if overlap_grad_reduce else None
        self._grad_buffers: Optional[Dict[torch.dtype, GradBuffer]] = None
        self._param_buffers: Dict[torch.dtype, torch.Tensor] = {}
        self.buckets: List[_Bucket] = []
        self.param_index_map: Dict[torch.nn.Parameter, tuple] = {}  # param -> (buffer key, start, end, bucket)
        self._hook_handles: List = []
        self._is_last_microbatch = True
        self._param_sync_pending = False
        if use_contiguous_buffers:
            self._build_buffers()
        if overlap_param_gather:
            self._register_param_wait_hooks()

    def _params(self) -> Iterator[torch.nn.Parameter]:
        return (p for p in self.module.parameters() if p.requires_grad)

    def _buffer_dtype(self, param: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.accumulate_allreduce_grads_in_fp32 else param.dtype

    def _is_expert(self, param: torch.Tensor) -> bool:
        return self.expert_dp_group is not None and getattr(param, "allreduce", True) is False

    def _buffer_key(self, param: torch.Tensor):
        """The buffer of a param: its grad dtype, or (dtype, "expert") for expert params under expert parallelism."""
        dtype = self._buffer_dtype(param)
        return (dtype, "expert") if self._is_expert(param) else dtype

    def _key_group(self, key):
        return self.expert_dp_group if isinstance(key, tuple) else self.dp_group

    def _build_buffers(self) -> None:
        by_key: Dict = {}
        for param in self._params():
            by_key.setdefault(self._buffer_key(param), []).append(param)
        layouts: Dict = {}
        sizes: Dict = {}
        for key, params in by_key.items():
            pad = _group_size(self._key_group(key)) if self.use_distributed_optimizer else 1
            # Backward visits params roughly in reverse order, so lay them out back to front (as Megatron does).
            layout, offset, bucket_start, current = [], 0, 0, []
            for param in reversed(params):
                isolate = self.use_distributed_optimizer and (
                    getattr(param, "shared", False) or getattr(param, "shared_embedding", False))
                if isolate and current:
                    offset = bucket_start = self._close_bucket(key, bucket_start, offset, current, pad)
                layout.append((param, offset))
                offset += param.numel()
                current.append(param)
                if isolate or (self.bucket_size is not None and offset - bucket_start >= self.bucket_size):
                    offset = bucket_start = self._close_bucket(key, bucket_start, offset, current, pad)
            if current:
                offset = self._close_bucket(key, bucket_start, offset, current, pad)
            layouts[key], sizes[key] = layout, offset
        devices = {key: params[0].device for key, params in by_key.items()}
        self._grad_buffers = {key: GradBuffer(sizes[key], key[0] if isinstance(key, tuple) else key, devices[key])
                              for key in by_key}
        bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        for key, layout in layouts.items():
            if self.use_distributed_optimizer:
                dtypes = {param.dtype for param, _ in layout}
                if len(dtypes) != 1:
                    raise TypeError(f"the distributed optimizer needs one param dtype per gradient buffer, got {dtypes}")
                self._param_buffers[key] = torch.zeros(sizes[key], dtype=dtypes.pop(), device=devices[key])
            for param, start in layout:
                end = start + param.numel()
                param.main_grad = self._grad_buffers[key].get(param.shape, start)
                self.param_index_map[param] = (key, start, end, bucket_of[param])
                if self.use_distributed_optimizer:  # the param now lives in the parameter buffer
                    view = self._param_buffers[key][start:end].view(param.shape)
                    view.copy_(param.data)
                    param.data = view
        for param in self._params():
            self._hook_handles.append(param.register_post_accumulate_grad_hook(self._accumulate_hook))

    def _close_bucket(self, key: torch.dtype, start: int, end: int, params: list, pad: int) -> int:
        """Record the bucket [start, end) padded to a multiple of `pad`; empties `params`; returns the padded end."""
        padded = start + -(-(end - start) // pad) * pad
        self.buckets.append(_Bucket(len(self.buckets), key, start, padded, list(params), self._key_group(key)))
        params.clear()
        return padded

    def _accumulate_hook(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        main_grad = param.main_grad
        # The FP32 optimizer points param.grad at main_grad; autograd then already accumulated in place.
        if grad.data_ptr() != main_grad.data_ptr():
            main_grad.add_(grad.data)
        param.grad = None
        if self.overlap_grad_reduce and self._is_last_microbatch:
            bucket = self.param_index_map[param][3]
            if bucket.launched:
                raise RuntimeError("a gradient arrived after its bucket's reduction started (a parameter used in two "
                                   "backward passes of the last micro-batch); drop --overlap-grad-reduce")
            bucket.ready.add(param)
            if len(bucket.ready) == len(bucket.params):
                self._launch_grad_reduction(bucket, async_op=True)

    def _launch_grad_reduction(self, bucket: _Bucket, async_op: bool) -> None:
        bucket.launched = True
        if bucket.group_size == 1 and self.dp_size == 1:  # (an expert bucket's group may be larger than DP's
            return  # under --expert-tensor-parallel-size < TP)
        data = self._grad_buffers[bucket.key].data[bucket.start:bucket.end]
        if self.dp_size > 1:
            data /= self.dp_size  # expert buckets too: Megatron scales every grad by 1 / data-parallel size
        if bucket.group_size == 1:
            return
        if self.use_distributed_optimizer:
            bucket.shard_out = torch.empty(bucket.numel // bucket.group_size, dtype=data.dtype, device=data.device)
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            bucket.handle = scatter(bucket.shard_out, data, group=bucket.group, async_op=async_op)
        else:
            bucket.handle = dist.all_reduce(data, group=bucket.group, async_op=async_op)

    @property
    def grad_buffers(self) -> Optional[Dict[torch.dtype, GradBuffer]]:
        return self._grad_buffers

    @property
    def param_buffers(self) -> Dict[torch.dtype, torch.Tensor]:
        """Parameter buffers (distributed optimizer only), keyed like `grad_buffers`."""
        return self._param_buffers

    def _reset_buckets(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.launched = False
            bucket.handle = None
            bucket.shard_out = None

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers (call once per iteration before the first micro-batch)."""
        if self._grad_buffers is not None:
            for buffer in self._grad_buffers.values():
                buffer.zero()
            self._reset_buckets()
        else:
            for param in self._params():
                param.grad = None
                param.main_grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches run inside accumulate only; the reduction (overlapped or not) follows the last one."""
        previous = self._is_last_microbatch
        self._is_last_microbatch = False
        try:
            yield
        finally:
            self._is_last_microbatch = previous

    def finish_grad_sync(self) -> None:
        """Finish the data-parallel gradient reduction: launch the buckets not yet started (all of them without
        overlap), wait for every bucket. Afterwards grads are averaged over the data-parallel group: everywhere
        (all-reduce) or, with the distributed optimizer, in this rank's shard of each bucket (reduce-scatter)."""
        if self._grad_buffers is None:
            self._allreduce_unbuffered()
            return
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch_grad_reduction(bucket, async_op=False)
        for bucket in self.buckets:
            if bucket.handle is not None and hasattr(bucket.handle, "wait"):
                bucket.handle.wait()
            if bucket.shard_out is not None:
                start, end = bucket.shard_range()
                self._grad_buffers[bucket.key].data[start:end].copy_(bucket.shard_out)
        self._reset_buckets()

    # Megatron's older name.
    allreduce_gradients = finish_grad_sync

    def _allreduce_unbuffered(self) -> None:
        dp_size = self.dp_size
        buckets: Dict = {}
        for param in self._params():
            if param.grad is not None:
                buckets.setdefault((param.grad.dtype, self._is_expert(param)), []).append(param)
                param.main_grad = param.grad
        for (_dtype, expert), params in buckets.items():
            group = self.expert_dp_group if expert else self.dp_group
            if dp_size == 1 and _group_size(group) == 1:
                continue
            grads = [p.grad.data for p in params]
            coalesced = flatten_dense_tensors(grads)
            if dp_size > 1:
                coalesced /= dp_size
            if _group_size(group) > 1:
                dist.all_reduce(coalesced, group=group)
            for buf, synced in zip(grads, unflatten_dense_tensors(coalesced, grads)):
                buf.copy_(synced)

    # ------------------------------------------------------------------ parameter all-gather (distributed optimizer)
    def start_param_sync(self, async_op: Optional[bool] = None) -> None:
        """All-gather the updated parameter shards of every bucket into the parameter buffer (forward order).
        Asynchronous with `overlap_param_gather` (default): the forward pre-hooks wait for each bucket."""
        if not self.use_distributed_optimizer:
            return
        self.finish_param_sync()
        if self.dp_size == 1 and _group_size(self.expert_dp_group) == 1:
            return
        async_op = self.overlap_param_gather if async_op is None else async_op
        for bucket in reversed(self.buckets):
            if bucket.group_size == 1:
                continue
            buffer = self._param_buffers[bucket.key]
            start, end = bucket.shard_range()
            handle = _all_gather_into(buffer[bucket.start:bucket.end], buffer[start:end].clone(), bucket.group,
                                      async_op)
            bucket.param_handle = handle if async_op else None
        self._param_sync_pending = bool(async_op)

    def _wait_param_bucket(self, bucket: _Bucket) -> None:
        if bucket.param_handle is not None:
            bucket.param_handle.wait()
            bucket.param_handle = None

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather (before evaluation, checkpointing or the next step)."""
        if not self._param_sync_pending:
            return
        for bucket in reversed(self.buckets):
            self._wait_param_bucket(bucket)
        self._param_sync_pending = False

    def _register_param_wait_hooks(self) -> None:
        """Forward pre-hooks: a module waits for the buckets of its own params; the whole chunk waits first for the
        output-layer weight, which the language-model head reads without calling its module."""
        index = self.param_index_map

        def wait_for(params) -> None:
            if not self._param_sync_pending:
                return
            for param in params:
                if param in index:
                    self._wait_param_bucket(index[param][3])

        for module in self.module.modules():
            own = [p for p in module.parameters(recurse=False) if p in index]
            if own:
                module.register_forward_pre_hook(lambda _m, _inputs, own=own: wait_for(own))

        def chunk_pre_hook(_module, _inputs) -> None:
            inner = self.module
            while isinstance(getattr(inner, "module", None), torch.nn.Module):
                inner = inner.module
            getter = getattr(inner, "output_weight", None)
            if callable(getter) and getattr(inner, "post_process", False):
                try:
                    wait_for([getter()])
                except RuntimeError:
                    pass

        self.module.register_forward_pre_hook(chunk_pre_hook)

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return super().state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(self, *args, **kwargs):
        self.finish_param_sync()
        return super().state_dict_for_save_checkpoint(*args, **kwargs)

    def broadcast_params(self) -> None:
        """Make every data-parallel rank start from dp-rank 0's weights."""
        for param in self.module.parameters():
            group = self.expert_dp_group if self._is_expert(param) else self.dp_group
            if _group_size(group) > 1:
                dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)


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
