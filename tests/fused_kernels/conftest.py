"""Triton's interpreter for the fused-kernel tests: TRITON_INTERPRET=1 must be set before a kernel is decorated (Triton
reads it then), so it is set when this folder is collected, before any kernel module is imported. It only changes how
Triton kernels run, and on a machine without a GPU nothing else runs Triton kernels."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
