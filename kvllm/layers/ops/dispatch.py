"""Whether the decoder layers run the fused Triton kernels or their plain torch code (the reference).

KVLLM_FUSED_OPS: unset or "auto" = the kernels for CUDA tensors when triton is installed; "0" = never;
"1" = always, CPU tensors included (tests run the kernels there under TRITON_INTERPRET=1).
Read once at import; `fused_ops_mode` switches it for a block of code.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENV = "KVLLM_FUSED_OPS"
_MODES = {"auto": "auto", "": "auto", "0": "off", "1": "on"}


def _mode_from_env() -> str:
    value = os.environ.get(ENV, "auto").strip().lower()
    if value not in _MODES:
        raise ValueError(f"{ENV}={value!r} is not valid; use 0 (torch ops), 1 (kernels always) or auto")
    return _MODES[value]


_mode = _mode_from_env()
_has_triton = importlib.util.find_spec("triton") is not None


def use_fused_ops(x: torch.Tensor) -> bool:
    """True where the layers should call the fused kernels for activations like `x`."""
    if _mode == "auto":
        return x.is_cuda and _has_triton
    return _mode == "on"


@contextmanager
def fused_ops_mode(mode: str) -> Iterator[None]:
    """Within the block, dispatch as if KVLLM_FUSED_OPS were `mode` ("auto", "0" or "1")."""
    global _mode
    if mode not in _MODES:
        raise ValueError(f"fused ops mode {mode!r} is not valid; use '0', '1' or 'auto'")
    previous, _mode = _mode, _MODES[mode]
    try:
        yield
    finally:
        _mode = previous
