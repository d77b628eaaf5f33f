"""Triton's interpreter for the fused-kernel tests: TRITON_INTERPRET=1 must be set before a kernel is decorated (Triton
reads it then), so it is set when this folder is collected, before any kernel module is imported, on a machine without
CUDA (where nothing else runs Triton kernels). On a CUDA machine the kernels are compiled for the GPU instead: the
interpreter tests skip there and tests/gpu/ checks the kernels on the device."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
