"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

A batch-1 decode step is a CUDA graph of about 250 kernels of 2-6 us each, run back to back, so the
gap between one kernel's end and the next one's first loads is a large share of the step. A kernel
launched with PDL (SM 9.0 and later) may start while the kernel before it still runs: its programs
become resident, load what no kernel of the step writes (a layer's weights), and wait in
`wait_for_previous_kernel` until the kernel before has finished and its writes are visible.

Every kernel that takes `USE_PDL` follows two rules, which keep it correct whatever runs around it:
- before `wait_for_previous_kernel`: loads of parameters only (weights no kernel of the step writes),
  never a store, never a load of an activation, a cache or a step input;
- the wait is followed at once by the signal that lets the next kernel launch, so the next kernel
  starts only after this one is past its wait, which is after the kernel before it completed: at most
  two kernels overlap, and everything written earlier in the step is complete when a kernel starts.
Kernels launched without PDL (torch's, cuBLAS's) start after their predecessor completes, as usual.

`KVLLM_PDL=0` in the environment turns it off (the A/B switch of the benchmarks). It is off under the
Triton interpreter and on devices below SM 9.0.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Wait until the kernel before this one has completed, then let the next kernel launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _device_has_pdl(device_index: int) -> bool:
    if os.environ.get("KVLLM_PDL", "1").strip() in ("0", "false", "False", "off"):
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on `t`'s device launch with PDL (the kernels' USE_PDL argument)."""
    if t.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _device_has_pdl(index)


def pdl_launch_options(use_pdl: bool) -> dict[str, bool]:
    """The launch keyword that goes with USE_PDL (nothing when off, so the interpreter never sees it)."""
    return {"launch_pdl": True} if use_pdl else {}
