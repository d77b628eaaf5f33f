"""Optional Triton fused kernels (Megatron's csrc/ CUDA kernels and torch.jit fusions, written in Triton) and the
rules that select them.

Kernels (each in its own module, imported only when selected, through `kernel_module`: they import Triton): scaled masked / causal masked softmax (softmax.py),
bias + tanh GeLU and bias + SwiGLU (activations.py), RMSNorm and LayerNorm (norms.py), RoPE (rope.py), the
vocab-parallel cross entropy (cross_entropy.py). Each has the numbers of the pure-PyTorch path it replaces (proven
under TRITON_INTERPRET=1 on CPU in tests/fused_kernels/).

Selection (`runs_on`): a tensor on CUDA with Triton importable and MEGATRON_NO_TRITON unset; then each seam applies
Megatron's switches and size rules: --no-masked-softmax-fusion and the fused softmax's shape constraints
(`softmax_fits`), --no-bias-gelu-fusion (which also selects erf GeLU, Megatron's meaning) and --no-bias-swiglu-fusion.
Without CUDA or without Triton every seam runs the pure-PyTorch path. Tests run the kernels on CPU tensors inside
`interpreter_on_cpu()` (TRITON_INTERPRET=1 set before the kernel modules are imported: Triton reads it when a kernel
is decorated).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any, Iterator, Optional

import torch

from megatron import optional

DISABLE_ENV = "MEGATRON_NO_TRITON"
# Largest hidden size the one-row-per-program norm kernels take (the whole row sits in one block).
MAX_NORM_HIDDEN = 32768
_CPU_INTERPRETER = {"on": False}


@functools.cache
def triton_importable() -> bool:
    """Triton is installed and imports (it is an optional dependency)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        optional.triton()
    except Exception:  # a broken install (missing compiler bits) counts as absent
        return False
    return True


@contextlib.contextmanager
def interpreter_on_cpu() -> Iterator[None]:
    """Let the kernels run on CPU tensors through Triton's interpreter (tests). TRITON_INTERPRET=1 must be set."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpreter_on_cpu needs TRITON_INTERPRET=1 set before the kernel modules are imported")
    before = _CPU_INTERPRETER["on"]
    _CPU_INTERPRETER["on"] = True
    try:
        yield
    finally:
        _CPU_INTERPRETER["on"] = before


def enabled(cuda: bool, triton: Optional[bool] = None) -> bool:
    """Triton kernels may run: on CUDA (or CPU under the tests' interpreter), Triton importable, not disabled."""
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        return False
    if not (cuda or _CPU_INTERPRETER["on"]):
        return False
    return triton_importable() if triton is None else triton


def runs_on(t: torch.Tensor) -> bool:
    """The kernels may run on tensor t's device."""
    return enabled(t.is_cuda or (t.device.type == "cpu" and _CPU_INTERPRETER["on"]))


def softmax_fits(fusion: bool, input_in_float16: bool, causal: bool, b: int, np_: int, sq: int, sk: int) -> bool:
    """Megatron 23.06's `FusedScaleMaskSoftmax.is_kernel_available` shape rule: --masked-softmax-fusion, fp16/bf16
    scores, 16 < sk <= 4096, sq and sk multiples of 4, b * np a multiple of 4; the causal kernel also needs sq == sk."""
    if not (fusion and input_in_float16 and 16 < sk <= 4096 and sq % 4 == 0 and sk % 4 == 0 and (b * np_) % 4 == 0):
        return False
    return sq == sk or not causal


def norm_fits(hidden: int) -> bool:
    return hidden <= MAX_NORM_HIDDEN


def bias_activation_kind(activation_name: str, bias_swiglu_fusion: bool) -> Optional[str]:
    """'gelu' where Megatron runs its fused bias_gelu (the tanh GeLU that --bias-gelu-fusion with a bias selects),
    'swiglu' for --swiglu unless --no-bias-swiglu-fusion, else None (the unfused activation)."""
    if activation_name == "gelu_tanh":
        return "gelu"
    if activation_name == "swiglu" and bias_swiglu_fusion:
        return "swiglu"
    return None


def kernel_module(name: str) -> ModuleType:
    """The kernel module `name` of this package (softmax, activations, norms, rope, cross_entropy). Each imports
    Triton, an optional dependency, at its top, so it is imported on first use, by the seam that selected it."""
    return importlib.import_module(f"{__name__}.{name}")


def bias_activation(kind: str, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    activations = kernel_module("activations")
    return activations.bias_gelu(x, bias) if kind == "gelu" else activations.bias_swiglu(x, bias)


def masked_softmax(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool) -> torch.Tensor:
    softmax = kernel_module("softmax")
    if causal:
        return softmax.scaled_upper_triang_masked_softmax(x, scale)
    return softmax.scaled_masked_softmax(x, mask, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernel_module("norms").rms_norm(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return kernel_module("norms").layer_norm(x, weight, bias, eps)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return kernel_module("rope").apply_rope(t, cos, sin)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                 group: Any = None) -> torch.Tensor:
    return kernel_module("cross_entropy").fused_vocab_parallel_cross_entropy(logits, target, vocab_start, group)


def active_kernels(cfg: Any, cuda: Optional[bool] = None, triton: Optional[bool] = None) -> tuple[list, str]:
    """(names of the Triton kernels this model will run, why the others do not) for a config or args namespace."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        return [], f"{DISABLE_ENV} is set"
    if not cuda:
        return [], "no CUDA"
    if not (triton_importable() if triton is None else triton):
        return [], "Triton is not installed"
    names, off = [], []
    float16 = bool(getattr(cfg, "fp16", False) or getattr(cfg, "bf16", False))
    if getattr(cfg, "masked_softmax_fusion", True) and float16:
        names.append("masked-softmax (explicit attention path, shapes permitting)")
    else:
        off.append("masked-softmax (" + ("--no-masked-softmax-fusion" if float16 else "fp32 scores") + ")")
    gelu = (getattr(cfg, "bias_gelu_fusion", True) and not getattr(cfg, "onnx_safe", False)
            and getattr(cfg, "add_bias_linear", True))
    if getattr(cfg, "swiglu", False):
        if getattr(cfg, "bias_swiglu_fusion", True):
            names.append("bias-swiglu")
        else:
            off.append("bias-swiglu (--no-bias-swiglu-fusion)")
    elif not (getattr(cfg, "openai_gelu", False) or getattr(cfg, "squared_relu", False)
              or getattr(cfg, "glu_activation", None)):
        if gelu:
            names.append("bias-gelu")
        else:
            off.append("bias-gelu (erf GeLU: --no-bias-gelu-fusion or no bias)")
    names.append("rmsnorm" if getattr(cfg, "normalization", "LayerNorm") == "RMSNorm" else "layernorm")
    if getattr(cfg, "position_embedding_type", "") == "rope":
        names.append("rope")
    names.append("vocab-parallel cross entropy (no label smoothing)")
    return names, "; ".join(off)


def describe(cfg: Any, cuda: Optional[bool] = None, triton: Optional[bool] = None) -> str:
    """The start-up line saying which fused kernels are active."""
    names, why = active_kernels(cfg, cuda, triton)
    if not names:
        return f"> fused kernels: none (pure PyTorch paths: {why})"
    line = "> fused kernels (Triton): " + ", ".join(names)
    return line + (f"; off: {why}" if why else "")
