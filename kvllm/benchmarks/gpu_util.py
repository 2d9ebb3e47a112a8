"""GpuUtilSampler: the GPU's busy fraction during a benchmark, sampled from NVML in a thread.

NVML's "utilization.gpu" is the fraction of its sampling period (1/6 s to 1 s) in which at least one
kernel ran; it says nothing about how full the SMs were. Sources, first that works: pynvml
(nvidia-ml-py), `torch.cuda.utilization()` (pynvml underneath), `nvidia-smi --query-gpu` polling.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from types import TracebackType

SAMPLE_INTERVAL_S = 0.1


def _device_index() -> int:
    import torch

    return torch.cuda.current_device()


def _pynvml_reader() -> Callable[[], float] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_device_index())
        pynvml.nvmlDeviceGetUtilizationRates(handle)
    except Exception:
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _torch_reader() -> Callable[[], float] | None:
    import torch

    try:
        torch.cuda.utilization()
    except Exception:  # torch raises ModuleNotFoundError or RuntimeError without pynvml
        return None
    return lambda: float(torch.cuda.utilization())


def _nvidia_smi_reader() -> Callable[[], float] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    cmd = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", f"--id={_device_index()}"]

    def read() -> float:
        return float(
            subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        )

    try:
        read()
    except Exception:
        return None
    return read


class GpuUtilSampler:
    """Context manager sampling GPU utilization (percent) while the block runs.

    `value` is the mean busy fraction in [0, 1], or None where no GPU or no NVML source exists;
    `source` names where the samples came from, or why there are none.
    """

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self.source: str = "unavailable"
        self._reader: Callable[[], float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._resolve_reader()

    def _resolve_reader(self) -> None:
        import torch

        if not torch.cuda.is_available():
            self.source = "not available: no CUDA device"
            return
        for name, factory in (
            ("pynvml", _pynvml_reader),
            ("torch.cuda.utilization", _torch_reader),
            ("nvidia-smi", _nvidia_smi_reader),
        ):
            reader = factory()
            if reader is not None:
                self._reader, self.source = reader, name
                return
        self.source = "not available: no pynvml, torch.cuda.utilization or nvidia-smi"

    @property
    def available(self) -> bool:
        return self._reader is not None

    @property
    def value(self) -> float | None:
        if not self.samples:
            return None
        return sum(self.samples) / len(self.samples) / 100.0

    def _loop(self) -> None:
        assert self._reader is not None
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.samples.append(self._reader())
            except Exception:
                return
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def __enter__(self) -> GpuUtilSampler:
        if self._reader is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="gpu-util-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def describe(self) -> str:
        value = self.value
        if value is None:
            return f"GPU utilization: {self.source}"
        return f"GPU utilization: {value * 100:.1f}% (mean of {len(self.samples)} samples from {self.source})"
