"""Tensor-parallel layers: vocabulary-parallel embedding, column- and row-parallel linear (Megatron semantics).

Weights are stored as in Megatron checkpoints: a linear weight is [output, input]; ColumnParallelLinear keeps
rows [r*out/tp, (r+1)*out/tp) (partition_dim 0), RowParallelLinear keeps input columns (partition_dim 1), the
embedding keeps a contiguous vocabulary range (partition_dim 0).

Deterministic initialisation: with `config.use_cpu_initialization` (the default here) each layer builds the full
master weight on CPU in fp32, fills it with `init_method` under the *current* torch RNG, casts it to
`config.params_dtype` and keeps this rank's shard. All TP ranks must therefore share the default RNG state (they do
after `model_parallel_manual_seed`), and for the same seed the TP=N shards concatenate exactly to the TP=1 weight.
Without it, only the shard is allocated (on CUDA when available) and initialised inside the tracker's
"model-parallel-rng" stream, as Megatron does on GPU.

Linear layers return `(output, bias)`: bias is None unless `skip_bias_add`, in which case the caller adds it
(so it can be fused). The embedding returns just the output tensor, like Megatron's.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch.nn.parameter import Parameter

from megatron.core import parallel_state
from megatron.core.tensor_parallel.layout import TensorParallelLayout, set_tp_layout
from megatron.core.tensor_parallel.lm_head import embedding_lookup
from megatron.core.tensor_parallel.mappings import (
    all_gather_along_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_along_first_dim,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import MODEL_PARALLEL_RNG_TRACKER_NAME, get_rng_tracker
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.utils import divide

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


# ---- parameter attributes -------------------------------------------------------------------------------------
def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: Optional[int] = None) -> bool:
    """True if this rank should count `param` (sharded params everywhere; replicated ones only on TP rank 0)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return tp_rank == 0


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark `tensor` as sharded along `dim` (Megatron's attribute names)."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise RuntimeError(f"parameter already has tensor-parallel attribute {attribute!r}")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


# ---- initialisation ---------------------------------------------------------------------------------------------
def _param_device(config: Any) -> Optional[torch.device]:
    get_default = getattr(torch, "get_default_device", None)  # torch >= 2.3
    if get_default is not None and get_default().type == "meta":
        return None  # inside `with torch.device("meta")`: a weightless model (layouts, shapes)
    if getattr(config, "use_cpu_initialization", True):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None  # torch's default device


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Callable,
    tp_group: Any,
    stride: int = 1,
    return_master_weight: bool = False,
    params_dtype: torch.dtype = torch.float32,
) -> Optional[torch.Tensor]:
    """Fill `weight` with this rank's shard of a full fp32 master weight initialised with `init_method`."""
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    master = torch.empty(output_size, input_size, dtype=torch.float32, requires_grad=False)
    init_method(master)
    master = master.to(dtype=params_dtype)
    per_partition_per_stride = divide(per_partition_size, stride)
    pieces = torch.split(master, per_partition_per_stride, dim=partition_dim)
    rank, world = group_rank(tp_group), group_size(tp_group)
    with torch.no_grad():
        torch.cat(pieces[rank::world], dim=partition_dim, out=weight.data)
    return master if return_master_weight else None


def _initialize_affine_weight_device(weight: torch.Tensor, init_method: Callable, partition_dim: int,
                                     stride: int = 1) -> None:
    """Initialise only the local shard, in the "model-parallel-rng" stream when it is registered."""
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG_TRACKER_NAME in tracker.states_:
        with tracker.fork(MODEL_PARALLEL_RNG_TRACKER_NAME):
            init_method(weight)
    else:
        init_method(weight)


def _perform_initialization(config: Any) -> bool:
    """False under --no-initialization: weights are allocated, not initialised (a checkpoint load follows)."""
    return bool(getattr(config, "perform_initialization", True))


def _make_weight(rows: int, cols: int, config: Any) -> Parameter:
    return Parameter(torch.empty(rows, cols, device=_param_device(config), dtype=config.params_dtype))


def _zero_bias(size: int, config: Any) -> Parameter:
    return Parameter(torch.zeros(size, device=_param_device(config), dtype=config.params_dtype))


# ---- embedding --------------------------------------------------------------------------------------------------
class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocabulary across the TP group; output is the full [.., embedding_dim] on every
    rank (ids outside my range contribute zeros, then an all-reduce sums the ranks)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable, config: Any,
                 tp_group: Any = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, self.tp_rank, self.tp_size
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _make_weight(self.num_embeddings_per_partition, embedding_dim, config)
        set_tp_layout(self.weight, TensorParallelLayout(dim=0, structure="vocabulary range"))
        if not _perform_initialization(config):
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        elif getattr(config, "use_cpu_initialization", True):
            _initialize_affine_weight_cpu(
                self.weight, num_embeddings, embedding_dim, self.num_embeddings_per_partition, 0, init_method,
                tp_group, params_dtype=config.params_dtype,
            )
        else:
            _initialize_affine_weight_device(self.weight, init_method, partition_dim=0, stride=1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if input_.device.type == "cpu" and input_.numel():  # cheap on CPU; on GPU it would force a sync
            low, high = int(input_.min()), int(input_.max())
            if low < 0 or high >= self.num_embeddings:
                raise ValueError(
                    f"token id out of range [0, {self.num_embeddings}) in embedding input (min {low}, max {high}); "
                    f"the data was tokenized with a larger vocabulary than --vocab-file / padded vocab size"
                )
        if self.tp_size > 1:
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked_input = input_ - self.vocab_start_index
            masked_input = masked_input.masked_fill(input_mask, 0)
        else:
            masked_input = input_
        output_parallel = embedding_lookup(masked_input, self.weight)
        if self.tp_size > 1:
            output_parallel = output_parallel.masked_fill(input_mask.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)


# ---- linear with fused communication ----------------------------------------------------------------------------
class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """Y = X Wᵀ + b with the TP communication of the input folded in.

    sequence_parallel: X arrives split along dim 0; it is all-gathered for the matmul, only the local chunk is
    saved, it is re-gathered in backward and dX is reduce-scattered.
    async_grad_allreduce: (no SP) dX is all-reduced over the TP group while dW is computed (the backward of
    `copy_to_tensor_model_parallel_region`).
    """

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                async_grad_allreduce: bool, sequence_parallel: bool, group: Any) -> torch.Tensor:
        ctx.save_for_backward(input_, weight)
        ctx.use_bias = bias is not None
        ctx.async_grad_allreduce = async_grad_allreduce
        ctx.sequence_parallel = sequence_parallel
        ctx.group = group
        total_input = all_gather_along_dim(input_, group, 0) if sequence_parallel else input_
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        input_, weight = ctx.saved_tensors
        group = ctx.group
        need_input, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        total_input = all_gather_along_dim(input_, group, 0) if ctx.sequence_parallel else input_
        # Under autocast the forward matmul ran in low precision but backward gets no autocast: compute the
        # gradients in the weight's dtype (autograd casts each gradient back to its input's dtype).
        grad_output = grad_output.to(weight.dtype)
        total_input = total_input.to(weight.dtype)

        grad_input = handle = None
        if need_input:
            grad_input = grad_output.matmul(weight)
            if ctx.async_grad_allreduce and group_size(group) > 1:
                grad_input = grad_input.contiguous()
                handle = torch.distributed.all_reduce(grad_input, group=group, async_op=True)

        grad_weight = grad_bias = None
        if need_weight:
            go2d = grad_output.reshape(-1, grad_output.size(-1))
            grad_weight = go2d.t().matmul(total_input.reshape(-1, total_input.size(-1)))
        if ctx.use_bias and need_bias:
            grad_bias = grad_output.reshape(-1, grad_output.size(-1)).sum(dim=0)

        if handle is not None:
            handle.wait()
        if grad_input is not None and ctx.sequence_parallel:
            grad_input = reduce_scatter_along_first_dim(grad_input, group)
        return grad_input, grad_weight, grad_bias, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,  # noqa: A002 - Megatron's argument name
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool = False,
    async_grad_allreduce: bool = False,
    sequence_parallel: bool = False,
    group: Any = None,
) -> torch.Tensor:
    """Functional form (Megatron's name). `gradient_accumulation_fusion` (an apex CUDA kernel) is accepted and
    ignored: weight gradients always go to `.grad`, from where the local DDP accumulates them into main_grad."""
    del gradient_accumulation_fusion
    if group_size(group) == 1:
        async_grad_allreduce = sequence_parallel = False
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, async_grad_allreduce, sequence_parallel, group
    )


def _resolve_sequence_parallel(sequence_parallel: Optional[bool], config: Any) -> bool:
    if sequence_parallel is None:
        return bool(getattr(config, "sequence_parallel", False))
    return bool(sequence_parallel)


# ---- column / row parallel linear ------------------------------------------------------------------------------
class ColumnParallelLinear(torch.nn.Module):
    """Y = X Wᵀ + b with W's output rows split across TP ranks: each rank computes Y's columns [r*out/tp, ...).

    gather_output: all-gather Y along the last dim (otherwise each rank keeps its Y slice).
    sequence_parallel (None → `config.sequence_parallel`): X is split along dim 0 and is all-gathered first.
    forward(input_, weight=None): `weight` overrides the layer's own (the tied output layer passes the word
    embeddings); with `skip_weight_param_allocation=True` the layer owns no weight and `weight` is required.
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable, tp_group: Any = None,
                 bias: bool = True, gather_output: bool = False, skip_bias_add: bool = False, stride: int = 1,
                 sequence_parallel: Optional[bool] = None, keep_master_weight_for_test: bool = False,
                 skip_weight_param_allocation: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.output_size_per_partition = divide(output_size, self.tp_size, "ColumnParallelLinear output size / TP")
        self.sequence_parallel = _resolve_sequence_parallel(sequence_parallel, config) and self.tp_size > 1
        if self.sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True is incompatible with sequence_parallel")
        self.async_tensor_model_parallel_allreduce = (
            bool(getattr(config, "async_tensor_model_parallel_allreduce", False))
            and self.tp_size > 1 and not self.sequence_parallel
        )
        self.gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        self.master_weight = None
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = _make_weight(self.output_size_per_partition, input_size, config)
            if not _perform_initialization(config):
                set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
            elif getattr(config, "use_cpu_initialization", True):
                self.master_weight = _initialize_affine_weight_cpu(
                    self.weight, output_size, input_size, self.output_size_per_partition, 0, init_method, tp_group,
                    stride=stride, return_master_weight=keep_master_weight_for_test, params_dtype=config.params_dtype,
                )
            else:
                _initialize_affine_weight_device(self.weight, init_method, partition_dim=0, stride=stride)
            set_tp_layout(self.weight, TensorParallelLayout(dim=0, blocks=stride))
        if bias:
            self.bias = _zero_bias(self.output_size_per_partition, config)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            set_tp_layout(self.bias, TensorParallelLayout(dim=0, blocks=stride))
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True; pass weight= to forward"
                )
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(
                f"ColumnParallelLinear: supplied weight has shape {tuple(weight.shape)}, expected "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        bias = self.bias if not self.skip_bias_add else None
        if self.sequence_parallel or self.async_tensor_model_parallel_allreduce:
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, self.tp_group)
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(
            input_parallel, weight, bias, self.gradient_accumulation_fusion,
            self.async_tensor_model_parallel_allreduce, self.sequence_parallel, self.tp_group,
        )
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        else:
            output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class RowParallelLinear(torch.nn.Module):
    """Y = X Wᵀ + b with W's input columns split across TP ranks: partial products are summed (all-reduce, or
    reduce-scatter along dim 0 under sequence parallelism) and the bias is added once, after the reduction.

    input_is_parallel: X is already split along its last dim (the output of a ColumnParallelLinear); otherwise it
    is scattered here. Under sequence parallelism the bias gets `sequence_parallel = True`: its gradient is partial
    on each TP rank and must be all-reduced over the TP group by the optimizer side (as for LayerNorm params).
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable, tp_group: Any = None,
                 bias: bool = True, input_is_parallel: bool = True, skip_bias_add: bool = False, stride: int = 1,
                 sequence_parallel: Optional[bool] = None, keep_master_weight_for_test: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.input_size_per_partition = divide(input_size, self.tp_size, "RowParallelLinear input size / TP")
        self.sequence_parallel = _resolve_sequence_parallel(sequence_parallel, config) and self.tp_size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        self.weight = _make_weight(output_size, self.input_size_per_partition, config)
        self.master_weight = None
        if not _perform_initialization(config):
            set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        elif getattr(config, "use_cpu_initialization", True):
            self.master_weight = _initialize_affine_weight_cpu(
                self.weight, output_size, input_size, self.input_size_per_partition, 1, init_method, tp_group,
                stride=stride, return_master_weight=keep_master_weight_for_test, params_dtype=config.params_dtype,
            )
        else:
            _initialize_affine_weight_device(self.weight, init_method, partition_dim=1, stride=stride)
        set_tp_layout(self.weight, TensorParallelLayout(dim=1, blocks=stride))
        if bias:
            self.bias = _zero_bias(output_size, config)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(
            input_parallel, self.weight, None, self.gradient_accumulation_fusion, False, False, self.tp_group
        )
        if self.sequence_parallel:
            output_ = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        if self.skip_bias_add:
            return output_, self.bias
        output = output_ + self.bias if self.bias is not None else output_
        return output, None

