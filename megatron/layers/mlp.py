"""Megatron's ParallelMLP: h -> ffn (column parallel) -> activation -> h (row parallel).

Activations (one of, from the config): Megatron's default GeLU, which with a bias and `bias_gelu_fusion` on is its
fused ``bias_gelu`` = the **tanh approximation** (HF ``gelu_new``/``gelu_fast``), else erf GeLU (``F.gelu``);
``--openai-gelu`` (tanh); ``--squared-relu``; gated ``--swiglu``: ``dense_h_to_4h`` has 2 * ffn rows and each TP
rank holds ``[gate_r; up_r]`` (Megatron-LM's layout), computing ``silu(gate) * up``; Megatron-DeepSpeed's
``--glu-activation geglu|liglu|reglu|swiglu`` (BigScience): the same two halves per rank ``[x1_r; x2_r]``, computing
``x1 * act(x2)`` with act = erf GeLU, identity, ReLU or SiLU (note: the activated half is the second one);
Megatron-LM core's ``--quick-geglu`` (x * sigmoid(1.702 x) on the first half) and, for it or --swiglu,
``--glu-linear-offset`` / ``--activation-func-clamp-value`` (GPT-OSS's clamped GLU: `ClampedGLU`).
On CUDA with Triton the tanh GeLU and --swiglu (unless --no-bias-swiglu-fusion) run as one fused bias + activation
kernel (megatron/fused_kernels/).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron import fused_kernels
from megatron.core import tensor_parallel
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.module import MegatronModule
from megatron.layers.utils import gelu_impl, openai_gelu


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Megatron's --squared-relu)."""
    return torch.pow(F.relu(x), 2)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up with a backward that writes d gate and d up straight into one [.., 2F] gradient (autograd
    through chunk would concatenate two fresh [.., F] gradients: an extra pass and buffer). The same element ops as
    ``F.silu(gate) * up`` and its autograd backward, so results are bitwise equal."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(x, 2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(x, activated)
        return activated * up

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        x, activated = ctx.saved_tensors
        return swiglu_grad(grad_output, x, activated)


def swiglu_grad(grad_output: torch.Tensor, x: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
    """The gradient of ``silu(gate) * up`` w.r.t. x = [gate | up], written into one [.., 2F] tensor (activated =
    silu(gate), saved by the forward); shared by _SwiGLU and the MoE experts' fused function."""
    gate, up = torch.chunk(x, 2, dim=-1)
    grad = torch.empty_like(x, memory_format=torch.contiguous_format)
    grad_gate, grad_up = torch.chunk(grad, 2, dim=-1)
    torch.mul(grad_output, up, out=grad_gate)
    torch.ops.aten.silu_backward(grad_gate, gate, grad_input=grad_gate)
    torch.mul(grad_output, activated, out=grad_up)
    return grad


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of the last dim ([gate; up] of this rank)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _SwiGLU.apply(x)
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x) (Megatron-LM core's quick_gelu; GPT-OSS's alpha)."""
    return x * torch.sigmoid(1.702 * x)


class ClampedGLU:
    """Megatron-LM core's gated activation with --glu-linear-offset / --activation-func-clamp-value: over the two
    halves [gate | linear] of the last dim, act(min(gate, c)) * (clamp(linear, -c, c) + offset) (a picklable
    callable; GPT-OSS: quick GeLU, c = 7, offset 1)."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor], offset: float, clamp: Optional[float]) -> None:
        self.act, self.offset, self.clamp = act, offset, clamp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, linear = torch.chunk(x, 2, dim=-1)
        if self.clamp is not None:
            gate = gate.clamp(min=None, max=self.clamp)
            linear = linear.clamp(min=-self.clamp, max=self.clamp)
        return self.act(gate) * (linear + self.offset)


_GLU_INNER: dict = {"geglu": F.gelu, "liglu": lambda x: x, "reglu": F.relu, "swiglu": F.silu}


class GLU:
    """Megatron-DeepSpeed's GLU activation: x1 * act(x2) over the two halves of the last dim (a picklable callable)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.inner = _GLU_INNER[name]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return x1 * self.inner(x2)


def activation_for(config: TransformerConfig) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
    """(name, function) of the MLP activation `config` selects, with Megatron 23.06's bias-gelu-fusion rule."""
    clamped = config.glu_linear_offset != 0.0 or config.activation_func_clamp_value is not None
    if config.quick_geglu:
        return "quick_geglu", ClampedGLU(quick_gelu, config.glu_linear_offset, config.activation_func_clamp_value)
    if config.swiglu and clamped:
        return "swiglu_clamped", ClampedGLU(F.silu, config.glu_linear_offset, config.activation_func_clamp_value)
    if config.swiglu:
        return "swiglu", swiglu
    if config.glu_activation is not None:
        return "glu_" + config.glu_activation, GLU(config.glu_activation)
    if config.squared_relu:
        return "squared_relu", squared_relu
    if config.openai_gelu:
        return "openai_gelu", openai_gelu
    if config.bias_gelu_fusion and config.add_bias_linear:
        return "gelu_tanh", gelu_impl  # Megatron's fused bias_gelu kernel is the tanh approximation
    return "gelu", F.gelu


class ParallelMLP(MegatronModule):
    """h -> ffn (column parallel) -> activation -> h (row parallel); returns (output, output_bias)."""

    def __init__(self, config: TransformerConfig, tp_group: Optional[Any] = None) -> None:
        super().__init__(config=config)
        gated = config.gated_linear_unit
        self.dense_h_to_4h = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            config.ffn_hidden_size * (2 if gated else 1),
            config=config,
            init_method=config.init_method,
            tp_group=tp_group,
            bias=config.add_bias_linear,
            gather_output=False,
            skip_bias_add=True,
            sequence_parallel=config.sequence_parallel,
            stride=2 if gated else 1,  # TP=N initialises to the same full [gate; up] weight as TP=1
        )
        if gated:
            for p in self.dense_h_to_4h.parameters():
                tensor_parallel.set_tp_layout(p, tensor_parallel.TensorParallelLayout(
                    dim=0, blocks=2, structure="[gate; up] per rank"))
        self.activation_name, self.activation_func = activation_for(config)
        self.fused_bias_activation = fused_kernels.bias_activation_kind(self.activation_name,
                                                                        config.bias_swiglu_fusion)
        self.dense_4h_to_h = tensor_parallel.RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            tp_group=tp_group,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            sequence_parallel=config.sequence_parallel,
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        intermediate, bias = self.dense_h_to_4h(hidden_states)
        if self.fused_bias_activation is not None and fused_kernels.runs_on(intermediate):
            return self.dense_4h_to_h(fused_kernels.bias_activation(self.fused_bias_activation, intermediate, bias))
        if bias is not None:
            intermediate = intermediate + bias
        intermediate = self.activation_func(intermediate)
        return self.dense_4h_to_h(intermediate)
