"""Kernel tests run Triton kernels on the CPU through the interpreter when no CUDA GPU is present.

TRITON_INTERPRET must be set before any @triton.jit kernel is defined, i.e. before the kernel
modules are imported by the test modules collected below.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
